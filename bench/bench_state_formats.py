"""Issue 34 items 2 and 4 — the optimizer-state formats where SSD bytes bind: step time and SSD bytes per
parameter per step for ``--optimizer-state fp32 | split | bf16 | int8``, side by side in one run.

Real SmolLM2-135M (the demo's model from ``~/.cache/fuyou``; ``fuyou/run/demo.py``), trained as ``fuyou
finetune`` would (clipping on, bf16 compute where the CPU computes bf16 fast: ``--precision``), with every
block's weights and optimizer state on the store (no RAM tier) and few tokens per step, so the store's bytes,
not compute, set the step. One engine per format, each with its own store under ``--dir``; the formats take
turns step by step (warm-up steps first), so a busy moment of the machine hits every format alike. Reported
per format: the median step time of ``--steps`` measured steps and its ratio to fp32's, and the SSD bytes read
and written per parameter per step — the engine's own count (``Timeline``: every store read and write, by the
step it serves, its update's included: ``StepResult.io``) totalled over the measured steps ÷ steps ÷
parameters — beside the planner's
prediction for the same plan (``fuyou.planner.cost.predict``). Bytes counted include the forward's and
backward's weight reads and the clipping schedule's parked gradients, where the plan parks them on the store.

    python bench/bench_state_formats.py --dir /tmp/formats                  # 135M, 5 + 2 steps
    python bench/bench_state_formats.py --dir /tmp/formats --steps 9 --seq-len 64
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import emit, hardware_info  # noqa: E402
from fuyou.engine import Engine, EngineConfig, Plan  # noqa: E402

FORMATS = ("fp32", "split", "bf16", "int8")


def engine(model_dir: str, store: str, fmt: str, a: argparse.Namespace) -> Engine:
    """An engine for ``fmt`` on a fresh store: state and weights on the store, clipping on."""
    shutil.rmtree(store, ignore_errors=True)
    os.makedirs(store)
    ec = EngineConfig(
        ssd_dirs=(store,),
        device="cpu",
        cpu_memory=a.cpu_memory,
        precision=a.precision,
        lr=1e-5,
        max_grad_norm=1.0,
        optimizer_state=fmt,
        plan=Plan(ram_weight_blocks=0, ram_state_blocks=0, state_chunk=1 << 22),
    )
    return Engine.from_pretrained(model_dir, ec)


def predicted(eng: Engine, fmt: str, a: argparse.Namespace) -> dict:
    """The planner's SSD bytes per step for the plan the engine runs (the demo machine's quick profile)."""
    from fuyou.models.description import describe_model
    from fuyou.planner.cluster import Cluster
    from fuyou.planner.cost import predict
    from fuyou.planner.graph import StepConfig
    from fuyou.planner.profile import HardwareProfile

    cb = 4 if a.precision == "fp32" else 2
    shape = describe_model(eng.adapter.config)
    cfg = StepConfig(1, a.seq_len, cb, Cluster(1), optimizer_state=fmt)
    rates = dict(ssd_read_Bps=1e9, ssd_write_Bps=1e9, h2d_Bps=1e10, d2h_Bps=1e10, pageable_Bps=1e10)
    prof = HardwareProfile(
        **rates, host_mem_Bps=1e10, device_mem_Bps=1e10, adam_params_per_s=1e8, device="cpu", device_peak_flops=1e12
    )
    p = predict(shape, eng.plan, cfg, prof)  # bytes do not depend on the speeds
    return {"ssd_read_bytes": p.ssd_read_bytes, "ssd_write_bytes": p.ssd_write_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the three stores go (an SSD)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per format")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--cpu-memory", default="2GiB")
    a = ap.parse_args()
    from fuyou.run.demo import demo_model_dir

    model_dir, real = demo_model_dir()
    gen = torch.Generator().manual_seed(0)
    engines = {f: engine(model_dir, os.path.join(a.dir, f), f, a) for f in FORMATS}
    params = sum(b.numel for b in next(iter(engines.values())).layout.blocks)
    vocab = next(iter(engines.values())).adapter.config.vocab_size
    times: dict[str, list[float]] = {f: [] for f in FORMATS}
    moved = {f: [0, 0] for f in FORMATS}
    results: dict[str, list] = {f: [] for f in FORMATS}
    for i in range(a.warmup + a.steps):
        ids = torch.randint(0, vocab, (1, a.seq_len), generator=gen)
        for f, eng in engines.items():
            t0 = time.perf_counter()
            st = eng.train_step(ids)
            t1 = time.perf_counter()
            if i >= a.warmup:
                times[f].append(t1 - t0)
                results[f].append(st)
    for f in engines:  # each step's bytes, its update's included (read now: the overlap kept)
        moved[f] = [sum(st.ssd_read_bytes for st in results[f]), sum(st.ssd_write_bytes for st in results[f])]
    raise SystemExit(report(engines, times, moved, params, real, a))


def report(engines: dict, times: dict, moved: dict, params: int, real: bool, a: argparse.Namespace) -> int:
    """Emit one JSON record and a Markdown table on stderr; close the engines."""
    base = statistics.median(times["fp32"])
    rows = {}
    for f, eng in engines.items():
        pred = predicted(eng, f, a)
        step = statistics.median(times[f])
        rows[f] = {
            "step_s": step,
            "step_ratio_vs_fp32": step / base,
            "read_B_per_param": moved[f][0] / a.steps / params,
            "written_B_per_param": moved[f][1] / a.steps / params,
            "predicted_read_B_per_param": pred["ssd_read_bytes"] / params,
            "predicted_written_B_per_param": pred["ssd_write_bytes"] / params,
            "plan": eng.plan.to_json(),
        }
        eng.close()
    emit({"bench": "state_formats", "hardware": hardware_info([a.dir]), "real_model": real, "params": params,
          "seq_len": a.seq_len, "precision": a.precision, "steps": a.steps, "warmup": a.warmup, "formats": rows})  # fmt: skip
    print(
        "| format | step s | ÷ fp32 | read B/param | written B/param | total | predicted read + written |",
        file=sys.stderr,
    )
    print("| --- | --- | --- | --- | --- | --- | --- |", file=sys.stderr)
    for f, r in rows.items():
        tot = r["read_B_per_param"] + r["written_B_per_param"]
        pt = r["predicted_read_B_per_param"] + r["predicted_written_B_per_param"]
        print(f"| {f} | {r['step_s']:.2f} | {r['step_ratio_vs_fp32']:.2f} | {r['read_B_per_param']:.2f} | "
              f"{r['written_B_per_param']:.2f} | {tot:.2f} | {pt:.2f} |", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    main()
