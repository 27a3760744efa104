"""``finetune(config)``: one fine-tuning run, what both ``fuyou finetune`` and scripts call.

A run directory holds ``model/`` (the trained Hugging Face model), ``metrics.jsonl`` (one line per
step) and ``run.json`` (the summary) — written last, so a directory without it is not a finished
run. The store lives under ``--ssd`` (default ``OUTPUT/store``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from typing import Any, Iterator

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.errors import ConfigError
from fuyou.finetune_config import FinetuneConfig
from fuyou.flops import FORMULA, train_flops_per_token
from fuyou.lr import lr_at
from fuyou.run_report import Progress, peak_rss, summary_table
from fuyou.units import parse_size


def prepare_output(path: str) -> str:
    """Create the run directory (or reuse it) and remove any previous run's finished markers.

    Raises ConfigError if it cannot be created or written.
    """
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".fuyou-write-test")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--output {path} is not writable ({e.strerror}); pass a writable directory") from None
    for stale in ("run.json", "model"):
        p = os.path.join(path, stale)
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.unlink(p)
    return path


def _model(cfg: FinetuneConfig) -> tuple[str, bool]:
    if cfg.model:
        return cfg.model, True
    from fuyou.demo import demo_model_dir

    return demo_model_dir()


def _engine_config(cfg: FinetuneConfig) -> EngineConfig:
    for d in cfg.store_dirs:
        os.makedirs(d, exist_ok=True) if d.startswith(os.path.abspath(cfg.output)) else None
    return EngineConfig(ssd_dirs=cfg.store_dirs, device=cfg.device, gpu_memory=cfg.gpu_memory,
                        cpu_memory=cfg.cpu_memory, precision=cfg.precision, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                        plan=Plan(micro_batches=cfg.grad_accum))


def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Run a fine-tuning job end to end; return the summary (also written to OUTPUT/run.json)."""
    from transformers import AutoTokenizer

    from fuyou.finetune_data import build_data
    from fuyou.models.adapters import architecture_of
    from fuyou.models.hf_io import ModelFileError, load_config

    out = prepare_output(cfg.output)
    cfg_store = FinetuneConfig(**{**cfg.__dict__, "output": out})
    model_dir, pretrained = _model(cfg)
    config = load_config(model_dir)
    architecture_of(config)  # unsupported models fail before any data is read
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise ModelFileError(f"cannot load the tokenizer of {model_dir}: {e}; the directory needs tokenizer files") from e
    data = build_data(cfg_store, tokenizer, config)
    engine = Engine.from_pretrained(model_dir, _engine_config(cfg_store))
    metrics_path = cfg.metrics or os.path.join(out, "metrics.jsonl")
    try:
        summary = _train(cfg_store, engine, data, metrics_path)
        engine.export(os.path.join(out, "model"), dtype=cfg.precision)
    finally:
        engine.close()
    summary.update(model=model_dir, pretrained=pretrained, output=os.path.join(out, "model"), metrics=metrics_path)
    with open(os.path.join(out, "run.json.tmp"), "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(os.path.join(out, "run.json.tmp"), os.path.join(out, "run.json"))
    if cfg.progress:
        summary_table(summary)
    return summary


def _evaluate(engine: Engine, batches: list) -> float | None:
    if not batches:
        return None
    return sum(engine.evaluate(ids, labels) for ids, labels in batches) / len(batches)


def _train(cfg: FinetuneConfig, engine: Engine, data: Any, metrics_path: str) -> dict[str, Any]:
    total = data.total_steps
    blocks = engine.layout.blocks
    width = engine.adapter.hidden
    layers = len(blocks) - 2
    fpt = train_flops_per_token(list(blocks), layers, width, cfg.seq_len)
    eval_before = _evaluate(engine, data.eval_batches)
    batches: Iterator = data.train_batches()
    progress = Progress(total, enabled=cfg.progress)
    t_start, tokens, written, read, first_loss, loss = time.perf_counter(), 0, 0, 0, None, None
    with open(metrics_path, "w") as mf, progress:
        for step in range(total):
            ids, labels = next(batches)
            engine.set_lr(lr_at(step, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, total))
            engine.timeline.clear()
            st = engine.train_step(ids, labels)
            tflops = fpt * st["tokens"] / st["step_time_s"] / 1e12
            rec = {"step": step + 1, "loss": st["loss"], "lr": st["lr"], "grad_norm": st["grad_norm"],
                   "applied": st["applied"], "tokens": st["tokens"], "step_time_s": st["step_time_s"],
                   "tokens_per_s": st["tokens_per_s"], "tflops": tflops, "flop_formula": FORMULA,
                   "flops_per_token": fpt, "busy_frac": st["busy_frac"], "bottleneck": st["bottleneck"],
                   "ssd_read_gb": st["ssd_read_bytes"] / 1e9, "ssd_write_gb": st["ssd_write_bytes"] / 1e9}
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            tokens += st["tokens"]
            written += st["ssd_write_bytes"]
            read += st["ssd_read_bytes"]
            first_loss = st["loss"] if first_loss is None else first_loss
            loss = st["loss"]
            progress.update(rec)
    if cfg.trace:
        engine.timeline.to_chrome_trace(cfg.trace)
    wall = time.perf_counter() - t_start
    eval_after = _evaluate(engine, data.eval_batches)
    summary = {"steps": total, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
               "first_loss": first_loss, "last_loss": loss, "eval_loss_before": eval_before,
               "eval_loss_after": eval_after, "peak_rss_bytes": peak_rss(), "ssd_write_bytes": written,
               "ssd_read_bytes": read, "cpu_memory_bytes": parse_size(cfg.cpu_memory), "flop_formula": FORMULA,
               "store_dirs": list(cfg.store_dirs)}
    return summary
