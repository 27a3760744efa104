"""``fuyou`` command line: thin click commands over the library.

torch and the rest of the data path are imported inside commands, so ``fuyou --help`` is instant.
Errors Fuyou raises on purpose print as one line (no traceback unless ``--debug``), exit code 1.
"""

from __future__ import annotations

import os
import sys

import click

from fuyou import __version__
from fuyou.run.reporters import REPORT_TO
from fuyou.schedule.plan import POLICIES
from fuyou.schedule.state_format import CHOICES


class FuyouGroup(click.Group):
    """Turns FuyouError into a one-line message and exit code 1 (traceback with --debug)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except Exception as e:
            from fuyou.errors import FuyouError

            if isinstance(e, FuyouError) and not ctx.meta.get("fuyou.debug"):
                click.echo(f"error: {e}", err=True)
                sys.exit(1)
            raise


@click.group(cls=FuyouGroup)
@click.version_option(__version__, prog_name="fuyou")
@click.option("--debug", is_flag=True, help="Show full tracebacks.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Full-parameter fine-tuning of LLMs larger than GPU memory, with state on NVMe SSDs."""
    ctx.meta["fuyou.debug"] = debug


@main.command()
@click.option(
    "--ssd", "ssd_dirs", multiple=True, required=True, type=click.Path(), help="Store directory (repeat per SSD)."
)
def doctor(ssd_dirs: tuple[str, ...]) -> None:
    """Check the machine: SSD directories (writable, O_DIRECT, space), memlock, GPU, kvikio, numba's threading layer."""
    from rich.console import Console
    from rich.table import Table

    from fuyou.run.doctor import run_checks

    checks = run_checks(list(ssd_dirs))
    table = Table("check", "status", "detail", show_lines=False)
    colour = {"ok": "green", "warn": "yellow", "fail": "red"}
    for c in checks:
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail)
    Console().print(table)
    if any(c.status == "fail" for c in checks):
        sys.exit(1)


DEMO_DEFAULTS = {
    "lr": 1e-4,
    "micro_batch_size": 1,
    "grad_accum": 2,
    "warmup_steps": 2,
    "steps": 8,
    "eval_fraction": 0.01,
}
"""The demo's settings: 8 steps of 2 × 256 tokens and ~1,300 held-out tokens, sized so the demo ends in
under 5 minutes on 2 CPU cores without fast bf16 (fp32 compute; measured in bench/RESULTS.md)."""


def _pairs(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected two numbers like 0.9,0.999, got {text!r}", param_hint="--betas") from None
    return a, b


@main.command()
@click.argument("model_dir", required=False)
@click.option(
    "--data",
    multiple=True,
    help="Training data (repeatable; globs allowed): JSONL or Parquet files, a datasets save_to_disk directory, or a "
    "hub dataset id ORG/NAME; records of text / prompt+completion / messages (ShareGPT conversations too).",
)
@click.option(
    "--columns",
    help="Read fields named otherwise: TARGET=COLUMN pairs, e.g. prompt=instruction+input,completion=output or "
    "messages=dialog (targets: text, prompt, completion, messages; a+b joins two text columns).",
)
@click.option("--output", type=click.Path(), help="Run directory (model/, metrics.jsonl, run.json).")
@click.option("--ssd", multiple=True, type=click.Path(), help="Store directory; repeat once per SSD.")
@click.option("--cpu-memory", help="Host-memory budget, e.g. 64GiB.")
@click.option("--gpu-memory", help="Device-memory budget, e.g. 20GiB.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]))
@click.option("--seq-len", type=int)
@click.option("--micro-batch-size", type=int)
@click.option("--grad-accum", type=int)
@click.option("--steps", type=int)
@click.option("--epochs", type=float)
@click.option("--lr", type=float)
@click.option("--weight-decay", type=float)
@click.option("--betas", help="beta1,beta2 (e.g. 0.9,0.999).")
@click.option("--eps", type=float)
@click.option("--lr-schedule", type=click.Choice(["constant", "linear", "cosine"]))
@click.option("--warmup-steps", type=int)
@click.option("--max-grad-norm", type=float, help="Global-norm clipping (0 = off).")
@click.option(
    "--precision",
    type=click.Choice(["auto", "bf16", "fp32"]),
    help="Compute dtype; auto (default): bf16 where the device computes it fast, else fp32.",
)
@click.option(
    "--optimizer-state",
    type=click.Choice(list(CHOICES)),
    help="How AdamW's state is stored. auto (default): the resumed store's, else split. split: the master as the "
    "compute weights + a remainder (updates identical to fp32's, 12 B/param instead of 14 beside bf16 weights); "
    "fp32: an fp32 master, m and v; bf16: split with bf16 m and v (lossy, 8 B/param); int8: split with 8-bit m and v, "
    "a scale per 256 elements (lossy, 6.03 B/param). A store keeps its format.",
)
@click.option("--seed", type=int)
@click.option("--metrics", type=click.Path(), help="Per-step metrics JSONL (default OUTPUT/metrics.jsonl).")
@click.option("--trace", type=click.Path(), help="Write a Perfetto trace of the last step here.")
@click.option(
    "--report-to",
    help=f"{' | '.join(REPORT_TO)}, or several joined by commas (tensorboard,wandb): also log each step (loss, "
    "held-out loss, lr, grad norm, speed, busy fractions, SSD GB) to OUTPUT/tensorboard (the report extra) "
    "and/or Weights & Biases (the wandb extra; WANDB_MODE=offline works without network). Default none.",
)
@click.option("--data-format", type=click.Choice(["auto", "text", "prompt_completion", "messages"]))
@click.option(
    "--packing",
    type=click.Choice(["auto", "documents", "concat"]),
    help="documents: each packed document attends only to itself (positions restart per document); concat: "
    "documents run on into each other. auto (default): documents for prompt/completion and messages data.",
)
@click.option(
    "--lora-rank", type=int, help="Train LoRA adapters of this rank on the frozen base (default: full fine-tuning)."
)
@click.option("--lora-alpha", type=int, help="LoRA scaling numerator: outputs × alpha / rank (default 2 × rank).")
@click.option("--lora-dropout", type=float, help="Dropout on the adapters' input (default 0).")
@click.option(
    "--lora-targets",
    help="Comma-separated module names the adapters wrap (e.g. q_proj,v_proj); default all-linear (every linear "
    "layer but the output head).",
)
@click.option("--merge", is_flag=True, default=None, help="LoRA: also write OUTPUT/model with the adapters merged in.")
@click.option(
    "--freeze",
    multiple=True,
    help="Parameter-name glob that does not train (repeatable), e.g. 'model.embed_tokens.*' or "
    "'model.layers.[0-7].*'; a block frozen whole has no optimizer state and is never written.",
)
@click.option(
    "--moe-balance",
    type=click.Choice(["global", "micro", "off"]),
    help="A mixture of experts' balance loss (weight: the config's router_aux_loss_coef): global (default) counts "
    "the experts' use over the whole step, micro per micro-batch (the HF model's own loss), off: none.",
)
@click.option("--eval-fraction", type=float, help="Share of the data held out for evaluation.")
@click.option("--eval-data", type=click.Path(), help="JSONL evaluated instead of a held-out share of --data.")
@click.option("--eval-every", type=int, help="Also evaluate the held-out loss every N steps (default: before/after).")
@click.option(
    "--keep-best",
    is_flag=True,
    default=None,
    help="Checkpoint at every evaluation and keep the one with the lowest held-out loss (needs --eval-every).",
)
@click.option(
    "--save-every",
    help="Checkpoint every N steps (200) or span of wall time (30min, 2h); 0 = never. Default 30min. "
    "Copy-free: each kept checkpoint pins at most one version of the state on the SSD.",
)
@click.option("--keep-checkpoints", type=int, help="Checkpoints to keep (default 2; a resume prunes to it first).")
@click.option("--resume", help="auto (newest intact checkpoint, else start fresh) or a checkpoint directory.")
@click.option(
    "--overwrite", is_flag=True, help="Let a fresh start replace an earlier run in OUTPUT/--ssd (else it refuses)."
)
@click.option(
    "--plan",
    type=click.Choice(["auto", "rules"]),
    help="auto: the cost-model planner picks the engine plan (default); rules: simple budget rules.",
)
@click.option(
    "--profile",
    type=click.Path(),
    help="Hardware profile for the planner (default ~/.cache/fuyou/hw.json, else measured now).",
)
@click.option("--prefetch-depth", type=int, help="Fix the weight prefetch depth instead of planning it.")
@click.option(
    "--activations",
    type=click.Choice(list(POLICIES)),
    help="Fix every layer's activation policy instead of planning it.",
)
@click.option("--config", "config_file", type=click.Path(), help="YAML file whose keys mirror these flags.")
@click.option("--no-progress", is_flag=True, help="No live progress bar or final table.")
def finetune(
    model_dir: str | None,
    config_file: str | None,
    no_progress: bool,
    overwrite: bool,
    betas: str | None,
    **flags: object,
) -> None:
    """Fine-tune MODEL_DIR (a Hugging Face directory, or a hub id ORG/NAME[@REVISION] resolved through the Hugging
    Face cache) out of core; without one, run the built-in demo."""
    from fuyou.run.config import load_yaml, merge
    from fuyou.run.loop import finetune as run
    from fuyou.run.stop import RunInterrupted, resume_command

    given = {k: v for k, v in flags.items() if v is not None and v != ()}
    if model_dir:
        given["model"] = model_dir
    if betas:
        given["betas"] = _pairs(betas)
    for key in ("ssd", "data"):
        if key in given:
            given[key] = tuple(given[key])  # type: ignore[arg-type]
    if no_progress:
        given["progress"] = False
    if overwrite:  # only when given: an absent flag must not override `overwrite: true` in --config
        given["overwrite"] = True
    file_values = load_yaml(config_file) if config_file else {}
    if "model" not in given and "model" not in file_values:  # the built-in demo: settings that show learning
        given = {**{k: v for k, v in DEMO_DEFAULTS.items() if k not in file_values}, **given}
        click.echo(
            "demo: fine-tuning SmolLM2-135M-Instruct out of core on Python's documentation "
            "(pass MODEL_DIR and --data for your own run)",
            err=True,
        )
    cfg = merge(file_values, given)
    try:
        summary = run(cfg)
    except RunInterrupted as e:
        how = "the same torchrun launch of" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        again = f"; resume with {how}:\n  {resume_command(sys.argv)}".replace(" :", ":")
        again = again if e.rank == 0 and e.checkpoint else ""
        click.echo(f"{e}{again}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # before training started: nothing to save
        click.echo("interrupted before training started; nothing was saved", err=True)
        sys.exit(130)
    if not cfg.progress and summary.get("rank", 0) == 0:
        click.echo(
            f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} → {summary['last_loss']:.4f}, "
            f"model in {summary['output']}"
        )


@main.command()
@click.argument("store_dirs", nargs=-1, required=True)
@click.argument("out_dir")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "bf16", "fp16", "fp32"]),
    default="auto",
    show_default=True,
    help="auto: the dtype of the checkpoint the run started from (its frozen weights then come out bit-identical).",
)
@click.option(
    "--checkpoint",
    help="Export this checkpoint of the run (its name, e.g. step-00000200, or best: the --keep-best one) "
    "instead of its last step.",
)
def export(store_dirs: tuple[str, ...], out_dir: str, dtype: str, checkpoint: str | None) -> None:
    """Write the current weights of a run's store (STORE_DIRS…) as a Hugging Face directory OUT_DIR."""
    from fuyou.engine.export import export_store

    export_store(list(store_dirs), out_dir, dtype, checkpoint)
    click.echo(f"exported to {out_dir}")


@main.command()
@click.argument("run_dir")
@click.option("--output", type=click.Path(), help="HTML file to write (default RUN_DIR/report.html).")
def report(run_dir: str, output: str | None) -> None:
    """Write a one-page HTML report of the run in RUN_DIR (finished, running or resumed): loss, speed,
    busy fractions and bottleneck, SSD traffic and drive endurance, plan vs measured, host memory."""
    from fuyou.run.html_report import write_report

    click.echo(f"report written to {write_report(run_dir, output)}")


def _register() -> None:
    from fuyou.cli.plan_cmd import plan_cmd, profile_cmd

    main.add_command(plan_cmd)
    main.add_command(profile_cmd)


_register()

if __name__ == "__main__":
    main()
