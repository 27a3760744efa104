"""``finetune(config)``: one fine-tuning run, what both ``fuyou finetune`` and scripts call.

A run directory holds ``model/`` (the trained Hugging Face model), ``metrics.jsonl`` (one line per
step; with ``--report-to tensorboard`` also ``tensorboard/``, the same numbers as TensorBoard scalars)
and ``run.json`` (the summary) — written last, so a directory without it is not a finished run. The
store lives under ``--ssd`` (default ``OUTPUT/store``). Nothing of an earlier run is deleted unless
asked: a fresh start over one refuses without ``--overwrite`` (``fuyou.run.directory``), and resuming an
older checkpoint sets the newer ones aside.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Iterator
from typing import Any

from fuyou.engine import Engine, EngineConfig, StepResult
from fuyou.errors import ConfigError, FuyouWarning
from fuyou.models.hub import is_hub_id, resolve_model
from fuyou.planner.cost import FLOP_FORMULA
from fuyou.run import reporters
from fuyou.run.config import FinetuneConfig, save_interval
from fuyou.run.lr import lr_at
from fuyou.run.plan_choice import WARMUP_STEPS, ChosenPlan, PlanRequest, check_profile, choose_plan, device_kind
from fuyou.run.report import Progress, peak_rss, summary_table
from fuyou.run.stop import RunInterrupted, StopRequest
from fuyou.run.tensorboard import TensorBoardLog
from fuyou.run.wandb_log import WandbLog
from fuyou.units import parse_size


def prepare_output(path: str) -> str:
    """Create the run directory (or reuse it); return its absolute path. Deletes nothing.

    Raises ConfigError if it is a file, or cannot be created or written.
    """
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--output {path} is a file, not a directory; pass a directory (new or a run's)")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".fuyou-write-test-{os.getpid()}")  # ranks probe at once
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--output {path} is not writable ({e.strerror}); pass a writable directory") from None
    return path


def _remove_empty(path: str) -> None:
    """Remove ``path`` and the directories below it that hold no file (what a run that stopped before
    writing anything made); any file keeps it and its parents."""
    for root, _dirs, _files in os.walk(path, topdown=False):
        try:
            os.rmdir(root)
        except OSError:  # not empty (a file, or another rank's), or gone
            pass


def _model(cfg: FinetuneConfig) -> tuple[str, bool]:
    """(the model's local directory, whether it is the user's): ``--model`` as given, or the snapshot of a hub id
    ``ORG/NAME[@REVISION]`` (``fuyou.models.hub``: downloaded into the hub cache if needed), or the demo model."""
    if cfg.model:
        if not is_hub_id(cfg.model):
            return cfg.model, True
        path = resolve_model(cfg.model)
        if cfg.progress:
            _log(f"model: {cfg.model} from the Hugging Face hub cache ({path})")
        return path, True
    from fuyou.run.demo import demo_model_dir

    return demo_model_dir()


def plan_request(cfg: FinetuneConfig, config: Any, stripes: list[str] | None = None, ranks: int = 1) -> PlanRequest:
    """What the plan chooser needs of this run (``cfg.precision`` resolved); the engine gets the same
    budgets. ``stripes``: this rank's store directories (default: ``cfg.store_dirs``); ``ranks``: how
    many train together (the plan is one rank's)."""
    return PlanRequest(
        model_config=config,
        store_dirs=tuple(stripes or cfg.store_dirs),
        cpu_memory=cfg.cpu_memory,
        gpu_memory=cfg.gpu_memory,
        device=cfg.device,
        precision=cfg.precision,
        optimizer_state=cfg.optimizer_state,
        micro_batch_size=cfg.micro_batch_size,
        grad_accum=cfg.grad_accum,
        seq_len=cfg.seq_len,
        clip=cfg.max_grad_norm > 0,
        mode=cfg.plan,
        prefetch_depth=cfg.prefetch_depth,
        activations=cfg.activations,
        profile=cfg.profile,
        profile_out=os.path.join(cfg.output, "profile.json"),
        ranks=ranks,
        lora=cfg.lora,
        freeze=tuple(cfg.freeze),
    )


def _engine_config(cfg: FinetuneConfig, req: PlanRequest, chosen: ChosenPlan, world: int = 1) -> EngineConfig:
    from fuyou.run.plan_choice import OptimizerSettings, engine_config
    from fuyou.storage.dirs import rank_template

    optim = OptimizerSettings(cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay, cfg.max_grad_norm)
    # the engine fills in {rank}/{local_rank} of the store directories
    return engine_config(req, chosen, optim, _batch(cfg, chosen), cfg.moe_balance, rank_template(cfg.store_dirs, world))


def _batch(cfg: FinetuneConfig, chosen: ChosenPlan) -> tuple[int, int, int] | None:
    """The steps' shape as the engine splits them (one rank's ``micro_batch_size × grad_accum``
    sequences into the plan's accumulation), for its admission before the store exists; None where
    the plan's accumulation does not divide them (``train_step`` then refuses the batch by name)."""
    seqs, k = cfg.micro_batch_size * cfg.grad_accum, chosen.plan.grad_accum
    return (seqs // k, cfg.seq_len, k) if seqs % k == 0 else None


def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Run a fine-tuning job end to end; return the summary (also written to OUTPUT/run.json) and
    this process's ``rank``.

    Under ``torchrun`` every rank runs it with the same arguments (``fuyou.run.ranks``): each trains its
    slice of every global batch on its shard of the state, in its own store directories; rank 0 writes
    the run directory. A rank that stops makes the others stop with RankLostError.
    """
    from fuyou.run.ranks import join, lost

    ranks = join(device_kind(cfg.device))  # before the output directory is touched
    fresh = not os.path.exists(cfg.output)
    try:
        summary = _finetune(cfg, ranks)
    except Exception as e:
        if fresh:  # a run refused or failed before it wrote anything leaves no directories behind
            _remove_empty(os.path.abspath(cfg.output))
        err = lost(e)
        if err is not None:
            raise err from e
        raise
    ranks.close()  # every rank passed _finetune's last barrier
    return summary


def _finetune(cfg: FinetuneConfig, ranks: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from fuyou.models.adapters import architecture_of
    from fuyou.models.hf_io import ModelFileError, load_config
    from fuyou.run.data import build_data
    from fuyou.run.directory import check_fresh_start

    out = prepare_output(cfg.output)
    cfg = FinetuneConfig(**{**cfg.__dict__, "output": out, "progress": cfg.progress and ranks.root})
    stripes = _stripes(cfg, ranks)
    if not cfg.resume:  # before any slow work: refuse to start over an earlier run unless --overwrite
        _on_every_rank(ranks, lambda: check_fresh_start(out, stripes, cfg.overwrite))
    if reporters.parse(cfg.report_to):  # rank 0 logs: it needs the packages, and every rank stops without them
        _on_every_rank(ranks, lambda: reporters.require(reporters.parse(cfg.report_to)) if ranks.root else None)
    model_dir, pretrained = _model(cfg)
    config = load_config(model_dir)
    architecture_of(config)  # unsupported models fail before any data is read
    cfg, precision = ranks.decide(lambda: _precision(cfg, stripes))
    cfg = _state_format(cfg, stripes)
    cfg = FinetuneConfig(**{**cfg.__dict__, "progress": cfg.progress and ranks.root})
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        from fuyou.errors import os_limit_error

        limit = os_limit_error(e, f"loading the tokenizer of {model_dir}", os.path.join(model_dir, "tokenizer.json"))
        if limit is not None:
            raise limit from e
        raise ModelFileError(
            f"cannot load the tokenizer of {model_dir}: {e}; the directory needs tokenizer files"
        ) from e
    check_tokenizer(tokenizer, config, model_dir)
    data = None
    for r in range(ranks.world):  # one rank at a time: the demo text and data index are shared files
        if r == ranks.rank:
            data = build_data(cfg, tokenizer, config, ranks.world)
        ranks.barrier()
    assert data is not None
    engine, state, chosen = _start(cfg, model_dir, config, ranks, stripes)
    if ranks.root:
        chosen.keep_profile()  # the run started: the profile it was planned with goes with it
    _say_precision(precision)
    metrics_path = cfg.metrics or os.path.join(out, "metrics.jsonl")
    try:
        with _pins_named(engine):  # a disk that fills up: say what the checkpoints hold
            summary = _train(cfg, engine, data, metrics_path, state, config, ranks)
            result = _export(cfg, engine, out)
    except BaseException:
        with contextlib.suppress(Exception):  # closing flushes: on a full disk it fails again, and would hide why
            engine.close()
        raise
    engine.close()
    log = _log if cfg.progress else lambda s: None
    req = plan_request(cfg, config, stripes, ranks.world)
    check = check_profile(chosen, req, summary.pop("steady_step_s"), log) if ranks.root else None
    if check and check["verdict"] == "re-measured":
        if check["cached"]:  # a cache every later run would have inherited
            warnings.warn(check["note"], FuyouWarning, stacklevel=2)
        else:
            log(f"planner: {check['note']}")
    summary.update(
        profile_check=check,
        model=model_dir,
        model_id=cfg.model if cfg.model and is_hub_id(cfg.model) else None,  # the hub id it was resolved from
        pretrained=pretrained,
        output=result,
        metrics=metrics_path,
        precision=precision.to_json(),
        plan={**chosen.info, "executed": engine.plan.to_json(), "state_chunk_executed": engine.layout.state_chunk},
        ranks=ranks.world,
    )
    if ranks.root:
        with open(os.path.join(out, "run.json.tmp"), "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(os.path.join(out, "run.json.tmp"), os.path.join(out, "run.json"))
    ranks.barrier()  # the run is finished for every rank once run.json exists
    if cfg.progress:
        summary_table(summary, out)
    return summary | {"rank": ranks.rank}


def check_tokenizer(tokenizer: Any, config: Any, model_dir: str) -> None:
    """Raises ConfigError (before any data is read or store written) if ``model_dir``'s tokenizer has more
    regular tokens than the model's embedding has rows (``vocab_size``): it is another model's. Tokens added
    beyond them (special tokens some checkpoints add) are checked where they occur (``Engine.train_step``)."""
    vocab, regular = int(config.vocab_size), int(getattr(tokenizer, "vocab_size", 0) or 0)
    if regular > vocab:
        raise ConfigError(
            f"the tokenizer in {model_dir} has {regular:,} tokens but the model's embedding has {vocab:,} rows "
            "(vocab_size in config.json): the tokenizer files are another model's; put the model's own there"
        )


def _export(cfg: FinetuneConfig, engine: Any, out: str) -> str:
    """Write the run's result; returns its path: OUTPUT/model (the trained model, in the dtype of the checkpoint
    it started from, as Trainer saves a model), or for LoRA OUTPUT/adapter (a PEFT adapter directory), with
    ``--merge`` also OUTPUT/model (merged)."""
    if cfg.lora is None:
        engine.export(os.path.join(out, "model"))
        return os.path.join(out, "model")
    base = cfg.model.split("@")[0] if cfg.model and is_hub_id(cfg.model) else cfg.model  # PEFT names no revision
    engine.export_adapter(os.path.join(out, "adapter"), base=base)
    if cfg.merge:
        engine.export(os.path.join(out, "model"))
    return os.path.join(out, "adapter")


def _on_every_rank(ranks: Any, check: Any) -> None:
    """Run ``check`` on every rank; if it raises on any, raise on all (this rank's error, or one naming
    the rank that refused), so no rank goes on alone."""
    from fuyou.errors import FuyouError

    err: Exception | None = None
    try:
        check()
    except FuyouError as e:
        err = e
    refused = [r for r, ok in enumerate(ranks.gather(err is None)) if not ok]
    if err is not None:
        raise err
    if refused:
        raise ConfigError(f"rank {refused[0]} refused to start (see its message); every rank stops")


def _store_template(cfg: FinetuneConfig, world: int) -> tuple[str, ...]:
    """The run's store directories as run.json records them: absolute, with ``{rank}`` where each rank
    has its own (``fuyou export RUN_DIR`` opens every rank's)."""
    from fuyou.storage.dirs import rank_template

    return tuple(os.path.abspath(d) for d in rank_template(cfg.store_dirs, world))


def _stripes(cfg: FinetuneConfig, ranks: Any = None) -> list[str]:
    """This rank's store directories (absolute; ``{rank}``/``{local_rank}`` filled in, and with several
    ranks a ``rank<r>`` subdirectory of a path without them, created when its parent exists)."""
    from fuyou.storage.dirs import rank_dirs, rank_template

    rank, world = (ranks.rank, ranks.world) if ranks is not None else (0, 1)
    template = rank_template(cfg.store_dirs, world)
    out = [os.path.abspath(d) for d in rank_dirs(template, rank, world, ranks.local_rank if ranks else 0)]
    for given, t, d in zip(cfg.store_dirs, template, out):
        if t != given and os.path.isdir(os.path.dirname(d)):
            os.makedirs(d, exist_ok=True)
    return out


def _precision(cfg: FinetuneConfig, stripes: list[str]) -> tuple[FinetuneConfig, Any]:
    """Resolve ``--precision`` once for the run (``fuyou.device.precision``): ``auto`` resuming a
    store takes the store's precision; otherwise bf16 or fp32 by the device's measured bf16 speed. The
    choice is printed when training starts (``_say_precision``); an explicit bf16 on a device where it is slow warns with the measured factor."""
    from fuyou.device import get_backend
    from fuyou.device.precision import PrecisionChoice, choose_precision
    from fuyou.storage.run_meta import precision_name

    meta = _stored_meta(stripes[0]) if cfg.resume and cfg.precision == "auto" else None
    stored = precision_name(meta.compute_dtype) if meta is not None else None
    if stored:
        choice = PrecisionChoice(stored, "auto", None, f"auto: the store being resumed computes in {stored}")
    else:
        choice = choose_precision(cfg.precision, get_backend(device_kind(cfg.device)))
    return FinetuneConfig(**{**cfg.__dict__, "precision": choice.precision}), choice


def _say_precision(choice: Any) -> None:
    """Print the precision decision as training starts; warn where an explicit bf16 is slow here."""
    import warnings

    from fuyou.device.precision import SLOW_FACTOR
    from fuyou.errors import FuyouWarning

    if choice.requested == "bf16" and (choice.bf16_slowdown or 0) > SLOW_FACTOR:
        warnings.warn(choice.reason, FuyouWarning, stacklevel=3)
    _log(f"precision: {choice.precision} ({choice.reason})")


def _state_format(cfg: FinetuneConfig, stripes: list[str]) -> FinetuneConfig:
    """``--optimizer-state auto`` resolved (``fuyou.schedule.state_format.resolve_format``): the format of the
    store being resumed, else ``split``; an explicit format is kept (a resume checks it against the store's)."""
    from fuyou.schedule.state_format import AUTO, resolve_format

    if cfg.optimizer_state != AUTO:
        return cfg
    meta = _stored_meta(stripes[0]) if cfg.resume else None
    stored = resolve_format(AUTO, meta.optimizer_state if meta is not None else None)
    return FinetuneConfig(**{**cfg.__dict__, "optimizer_state": stored})


def _stored_meta(first: str) -> Any:
    """The ``StoreMeta`` of the store in the run's first store directory ``first``, or None if there is none
    (or its manifest cannot be read: the resume itself reports that)."""
    from fuyou.storage.manifest import MANIFEST, read_manifest
    from fuyou.storage.run_meta import StoreMeta

    if not os.path.isfile(os.path.join(first, MANIFEST)):
        return None
    try:
        return StoreMeta.from_json(read_manifest(first).get("meta", {}), first)
    except Exception:  # noqa: BLE001 - an unreadable manifest is reported by the resume itself
        return None


def _start(
    cfg: FinetuneConfig, model_dir: str, config: Any, ranks: Any, stripes: list[str]
) -> tuple[Engine, dict | None, ChosenPlan]:
    """A fresh engine from the model, or one restored from a checkpoint (``--resume``) with its trainer
    state, running the plan chosen for this run (``fuyou.run.plan_choice``; by rank 0, for every rank).

    Deletes nothing of an earlier run except with ``--overwrite`` on a fresh start; checkpoints newer
    than the one resumed (or, when ``auto`` found none intact, the damaged ones) are set aside.
    Raises ConfigError when ``auto`` would start fresh over a finished model without ``--overwrite``.
    """
    from fuyou.checkpoint import restore
    from fuyou.checkpoint.resume import agreed_resume_point

    for d in stripes:
        if d.startswith(os.path.abspath(cfg.output)):
            os.makedirs(d, exist_ok=True)
    point = agreed_resume_point(stripes, cfg.resume, ranks) if cfg.resume else None
    _on_every_rank(ranks, lambda: _make_way(cfg, stripes, point, ranks.root))
    req = plan_request(cfg, config, stripes, ranks.world)
    chosen = ranks.decide(lambda: choose_plan(req, log=_log if cfg.progress else lambda s: None))
    ec = _engine_config(cfg, req, chosen, ranks.world)
    if point is None:
        engine, state = Engine.from_pretrained(model_dir, ec), None
    else:
        restore(stripes, point[0])
        engine, state = Engine.resume(ec), point[1]
    try:
        _on_every_rank(ranks, lambda: _check_room(cfg, engine))
    except BaseException:
        engine.close()
        raise
    return engine, state, chosen


def _check_room(cfg: FinetuneConfig, engine: Engine) -> None:
    """Refuse (StoreSpaceError) a run whose kept checkpoints will not fit on its --ssd filesystems
    (``fuyou.checkpoint.room``); a run without checkpoints, or LoRA's (whose base no step rewrites,
    so a checkpoint pins only the adapters), is not checked."""
    from fuyou.checkpoint.room import check_room
    from fuyou.run.config import save_interval

    if save_interval(cfg.save_every) == (0, 0.0) or cfg.lora is not None:
        return
    check_room(list(engine.store.dirs), engine.store.committed()[1], cfg.keep_checkpoints)


def _make_way(cfg: FinetuneConfig, stripes: list[str], point: tuple[str, dict] | None, root: bool = True) -> None:
    """Clear what the starting run would collide with: ``--overwrite`` on a fresh start deletes the
    earlier run; otherwise checkpoints are only set aside (a resume then prunes the older ones to
    ``--keep-checkpoints``, keeping the one it resumes from and ``--keep-best``'s), and the old run.json and model/ removed
    (this run writes new ones) once it is clear that a finished model is not being replaced. Only
    rank 0 (``root``) touches the run directory's shared files; every rank its own store."""
    from fuyou.checkpoint import prune, remove_all
    from fuyou.checkpoint.resume import set_aside_newer
    from fuyou.run.directory import check_fresh_after_auto, clear_finished

    if point is None and cfg.overwrite:
        if root:
            clear_finished(cfg.output)
        remove_all(stripes)
        return
    if point is None and cfg.resume:
        check_fresh_after_auto(cfg.output, cfg.overwrite)
    if cfg.resume:
        set_aside_newer(stripes, point[0] if point else None)
        if point is not None:  # --keep-checkpoints K applies before training needs the room they pin
            best = (point[1].get("counters") or {}).get("best") or {}
            prune(stripes, cfg.keep_checkpoints, tuple(n for n in (point[0], best.get("checkpoint")) if n))
    if root:
        clear_finished(cfg.output)


def _log(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr)


def _evaluate(engine: Engine, batches: list) -> float | None:
    if not batches:
        return None
    return sum(engine.evaluate(ids, labels, pos) for ids, labels, pos in batches) / len(batches)


def _checkpoint(cfg: FinetuneConfig, engine: Engine, data: Any, step: int, counters: dict, ranks: Any) -> float:
    """Save a checkpoint after ``step`` steps; return the training stall in seconds. With several ranks
    each takes its own, then rank 0 marks it held by all; only then are older ones pruned (never
    ``--keep-best``'s, ``counters["best"]``)."""
    from fuyou.checkpoint import prune, take
    from fuyou.checkpoint.resume import checkpoint_name, encode_rng, mark_all_ranks

    t0 = time.perf_counter()
    engine.flush()  # only committed state is checkpointed
    state = {
        "step": step,
        "loader": data.loader.state_dict(),
        "rng": encode_rng(engine.backend.rng_state()),
        "engine_step": engine.step,
        "counters": counters,
    }
    take(engine.store, checkpoint_name(step), state)
    if ranks.world > 1:
        ranks.barrier()  # every rank holds it
        if ranks.root:
            mark_all_ranks(list(engine.store.dirs), checkpoint_name(step), ranks.world)
        ranks.barrier()  # marked: the older ones may go
    best = (counters.get("best") or {}).get("checkpoint")
    prune(list(engine.store.dirs), cfg.keep_checkpoints, (best,) if best else ())
    return time.perf_counter() - t0


def _train(
    cfg: FinetuneConfig, engine: Engine, data: Any, metrics_path: str, state: dict | None, config: Any, ranks: Any
) -> dict[str, Any]:
    from fuyou.checkpoint.resume import checkpoint_name, decode_rng
    from fuyou.models.description import describe_model

    total = data.total_steps
    fpt = describe_model(config).train_flops_per_token(cfg.seq_len, cfg.lora_rank is not None)  # FLOP_FORMULA
    c: dict[str, Any] = {
        "tokens": 0,
        "written": 0,
        "read": 0,
        "first_loss": None,
        "loss": None,
        "wall": 0.0,
        "stall": 0.0,
        "step_times": [],
        "eval_before": None,
        "best": None,
    }
    start = 0
    metrics = metrics_path if ranks.root else os.devnull  # rank 0 writes the run's metrics
    if state is None:
        c["eval_before"] = _evaluate(engine, data.eval_batches)
        open(metrics, "w").close()
    else:
        start, c = state["step"], state["counters"]
        data.loader.load_state_dict(state["loader"])
        engine.backend.set_rng_state(decode_rng(state["rng"]))
        if ranks.root:
            _truncate_lines(metrics_path, start)
    batches: Iterator = data.train_batches()
    progress = Progress(total, enabled=cfg.progress)
    names = reporters.parse(cfg.report_to) if ranks.root else ()
    every, seconds = save_interval(cfg.save_every)
    last_save = time.monotonic()
    with (
        open(metrics, "a") as mf,
        progress,
        reporters.open_reporters(names, cfg.output, start, _settings(cfg)) as tb,
        StopRequest() as stop,
    ):
        if state is None:
            tb.eval_loss(0, c["eval_before"])
        progress.advance_to(start)
        params = sum(engine.layout.numel(b) for b in range(len(engine.layout.blocks)))
        lines = _Lines(mf, tb, progress, c, params)
        for step in range(start, total):
            t0 = time.perf_counter()
            ids, labels, pos = next(batches)  # the global batch: this rank trains its slice
            n = ids.shape[0] // ranks.world
            per = slice(ranks.rank * n, (ranks.rank + 1) * n)
            engine.set_lr(lr_at(step, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, total))
            engine.timeline.clear()
            st = engine.train_step(ids[per], labels[per], None if pos is None else pos[per])
            rec = _record(step, st, fpt, ranks.world)
            lines.write()  # the previous step's line: its bytes are final now (its update has issued them)
            c["tokens"] += st.tokens * ranks.world
            c["first_loss"] = st.loss if c["first_loss"] is None else c["first_loss"]
            c["loss"] = st.loss
            c["wall"] += time.perf_counter() - t0
            c["step_times"].append(st.step_time_s)
            done = step + 1
            evaluated = cfg.eval_every and done % cfg.eval_every == 0 and done < total
            if evaluated:
                rec["eval_loss"] = _evaluate(engine, data.eval_batches)
                tb.eval_loss(done, rec["eval_loss"])
            lines.hold(rec, st)
            due = bool(seconds) and time.monotonic() - last_save >= seconds
            better = bool(cfg.keep_best and evaluated and _improves(c, rec["eval_loss"]))
            stopping, due, best = _agree(ranks, stop.signum or 0, due, better)
            if best:
                c["best"] = {"eval_loss": rec["eval_loss"], "checkpoint": checkpoint_name(done), "step": done}
            saved = False
            progress.update(rec)
            if (stopping and (every or seconds)) or best or ((every and done % every == 0 or due) and done < total):
                lines.write()  # the checkpoint's counters and metrics.jsonl include this step
                c["stall"] += _checkpoint(cfg, engine, data, done, c, ranks)
                saved, last_save = True, time.monotonic()
            if stopping:
                lines.write()
                _interrupted(stopping, done, saved, engine, ranks)
        lines.write()
        if cfg.trace:
            engine.timeline.to_chrome_trace(cfg.trace)
        eval_after = _evaluate(engine, data.eval_batches)
        tb.eval_loss(total, eval_after)
        outside = engine.io_outside()  # the import, evaluations, flushes: not the steps'
    return {
        "steps": total,
        "tokens": c["tokens"],
        "wall_s": c["wall"],
        "tokens_per_s": c["tokens"] / max(c["wall"], 1e-9),
        "first_loss": c["first_loss"],
        "last_loss": c["loss"],
        "eval_loss_before": c["eval_before"],
        "eval_loss_after": eval_after,
        "peak_rss_bytes": peak_rss(),
        **_device_figures(engine),
        "ssd_write_bytes": c["written"],
        "ssd_read_bytes": c["read"],
        "ssd_outside_read_bytes": outside[0],
        "ssd_outside_write_bytes": outside[1],
        "optimizer_state": engine.layout.optimizer_state.name,
        "stored_params": params,
        "checkpoint_stall_s": c["stall"],
        "resumed_from_step": start,
        "cpu_memory_bytes": parse_size(cfg.cpu_memory),
        "flop_formula": FLOP_FORMULA,
        "store_dirs": list(_store_template(cfg, ranks.world)),
        "tensorboard": tb.dir_of(TensorBoardLog),
        "wandb": tb.dir_of(WandbLog),
        "best_checkpoint": _best_path(engine, c.get("best")),
        "best_eval_loss": (c.get("best") or {}).get("eval_loss"),
        "steady_step_s": statistics.median(c["step_times"][WARMUP_STEPS:]) if c["step_times"][WARMUP_STEPS:] else None,
    }


def _settings(cfg: FinetuneConfig) -> dict[str, Any]:
    """The run's settings as JSON values (W&B records them as its run's config)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.__dict__.items()}


def _agree(ranks: Any, signum: int, due: bool, best: bool) -> tuple[int, bool, bool]:
    """(stop signal or 0, checkpoint due, new best held-out loss) the same on every rank: the first
    signal any rank got (by rank order); a time-based checkpoint and ``--keep-best``'s verdict as rank
    0 sees them (its clock, its held-out loss). One small gather per step with several ranks."""
    if ranks.world == 1:
        return signum, due, best
    votes = ranks.gather((signum, due, best))
    return next((v[0] for v in votes if v[0]), 0), votes[0][1], votes[0][2]


def _improves(c: dict, loss: float | None) -> bool:
    """Whether held-out ``loss`` is lower than ``--keep-best``'s best so far."""
    best = c.get("best")
    return loss is not None and (best is None or loss < best["eval_loss"])


def _best_path(engine: Engine, best: dict | None) -> str | None:
    """The ``--keep-best`` checkpoint's directory (in the first store directory), or None."""
    from fuyou.checkpoint.snapshot import CKPT

    return os.path.join(engine.store.dirs[0], CKPT, best["checkpoint"]) if best else None


def _interrupted(signum: int, step: int, saved: bool, engine: Engine, ranks: Any) -> None:
    """Raise RunInterrupted after a stop signal: ``step`` steps done, checkpointed if ``saved``."""
    import signal as sig

    from fuyou.checkpoint.resume import checkpoint_name

    name = sig.Signals(signum).name
    where = checkpoint_name(step) if saved else None
    raise RunInterrupted(
        f"stopped on {name} after step {step}"
        + (
            f"; checkpoint {where} saved in {engine.store.dirs[0]}"
            if where
            else "; nothing saved (checkpoints are off: --save-every 0)"
        ),
        signum,
        step,
        where,
        ranks.rank,
    )


@contextlib.contextmanager
def _pins_named(engine: Engine) -> Iterator[None]:
    """Extend a disk-full StoreSpaceError raised inside by what the checkpoints hold (``space_note``);
    a bare ENOSPC/EDQUOT OSError (a manifest or checkpoint file that did not fit) becomes one too.
    Whatever did not fit was never published: the last commit and checkpoints stay intact."""
    import errno

    from fuyou.checkpoint.room import space_note
    from fuyou.errors import StoreSpaceError

    try:
        yield
    except StoreSpaceError as e:
        if "disk full" not in str(e):
            raise
        raise StoreSpaceError(f"{e}; {space_note(list(engine.store.dirs))}") from e
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" ({e.filename})" if e.filename else ""
        raise StoreSpaceError(
            f"disk full{where}: {e.strerror}; free space or add another --ssd directory; "
            f"{space_note(list(engine.store.dirs))}"
        ) from e


def _device_figures(engine: Any) -> dict:
    """Device memory of the run in bytes: the measured peak (the CPU backend counts every tensor
    compute allocates, as a GPU's allocator does), the device-memory model's prediction for the
    largest step, and the budget."""
    mem = engine.backend.memory()
    pred = engine.predicted_peak
    return {
        "device_peak_bytes": mem.peak,
        "device_predicted_bytes": pred.nbytes if pred is not None else None,
        "device_budget_bytes": mem.capacity,
    }


def _record(step: int, st: StepResult, fpt: int, world: int = 1) -> dict:
    """One metrics.jsonl line: tokens and speed of the whole step (every rank's slice of the global
    batch, ``world`` ranks), SSD bytes and busy fractions of this rank."""
    tokens = st.tokens * world
    return (
        {
            "step": step + 1,
            "loss": st.loss,
            "lr": st.lr,
            "grad_norm": st.grad_norm,
            "applied": st.applied,
            "tokens": tokens,
            "step_time_s": st.step_time_s,
            "tokens_per_s": tokens / st.step_time_s,
            "tflops": fpt * tokens / st.step_time_s / 1e12,
            "flop_formula": FLOP_FORMULA,
            "flops_per_token": fpt,
            "busy_frac": st.busy_frac,
            "bottleneck": st.bottleneck,
        }
        | ({"ranks": world} if world > 1 else {})
        | ({"moe_balance_loss": st.moe_balance_loss} if st.moe_balance_loss is not None else {})
    )


class _Lines:
    """metrics.jsonl and the reporters, one step behind: a step's line is written once its bytes are final
    (``StepIO``: its update may run into the next step), at the next step's end, before a checkpoint, a
    stop or the run's end. ``write`` adds the held step's SSD bytes to the run's counters ``c``, and per
    parameter stored (``params``, this rank's) to the line."""

    def __init__(self, f: Any, reporters: Any, progress: Progress, c: dict[str, Any], params: int) -> None:
        self.f, self.reporters, self.progress, self.c, self.params = f, reporters, progress, c, max(params, 1)
        self.held: tuple[dict, StepResult] | None = None

    def hold(self, rec: dict, st: StepResult) -> None:
        """Keep step ``st``'s line ``rec`` until ``write``."""
        self.held = (rec, st)

    def write(self) -> None:
        """Complete the held line with its step's bytes and write it (nothing held: nothing)."""
        if self.held is None:
            return
        rec, st = self.held
        self.held = None
        read, written = st.ssd_read_bytes, st.ssd_write_bytes
        rec |= {"ssd_read_gb": read / 1e9, "ssd_write_gb": written / 1e9}
        rec |= {"ssd_read_B_per_param": read / self.params, "ssd_write_B_per_param": written / self.params}
        if "ranks" in rec:
            rec["comm_gb"] = st.comm_bytes / 1e9
        self.c["read"] += st.ssd_read_bytes
        self.c["written"] += st.ssd_write_bytes
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        self.reporters.step(rec)
        self.progress.ssd_rate(rec)


def _truncate_lines(path: str, n: int) -> None:
    """Keep the first ``n`` lines of ``path`` (metrics of steps a resumed run will not redo)."""
    lines = open(path).readlines()[:n] if os.path.exists(path) else []
    with open(path, "w") as f:
        f.writelines(lines)
