"""Predicted ÷ measured device peak: the device-memory model (``fuyou.schedule.device_memory``) against
what the engine holds, counted by the CPU backend's allocation meter (every tensor compute allocates,
as a GPU's allocator would; ``fuyou.device.cpu_allocations``).

Two parts, both on this machine's CPU backend (a CPU figure: a GPU run is the check that counts):

* ``draws``: random tiny models (Llama, Qwen2, GPT-2, Mixtral, Qwen3-MoE, tied Llama), activation
  policies, precisions and batch shapes, seeded; one engine run of two steps each. Figure per draw:
  the engine's predicted peak for the step ÷ the measured peak (target 1.0–1.1).
* ``smollm2``: real SmolLM2-135M through ``fuyou finetune`` with the CLI's defaults (planner on,
  clipping on) at ``--gpu-memory`` 512 MiB, 1 GiB and 2 GiB (fp32, seq 256, micro-batch 2 × 2
  accumulated, ``--cpu-memory 1GiB``: the issue's setting): the plan, the measured peak, the
  engine's prediction, or the one-line refusal.

* ``meter``: what counting costs per op (a chain of small element-wise ops, median of 7): plain, under
  an empty TorchDispatchMode, under the meter. (CUDA's backend does not count: its cost there is 0.)

    python bench/bench_device_peak.py                  # draws and smollm2 (~3 minutes on 2 cores)
    python bench/bench_device_peak.py --part draws --draws 40 --seed 1
    python bench/bench_device_peak.py --part meter
    python bench/bench_device_peak.py --smoke          # two draws and the meter (the test)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, hardware_info  # noqa: E402

FAMILIES = ("llama", "qwen2", "gpt2", "mixtral", "qwen3_moe", "llama_tied")
POLICIES = ("keep", "recompute", "swap_cpu", "swap_ssd", "recompute_cpu")
BUDGETS = ("512MiB", "1GiB", "2GiB")


def draw(rng: random.Random) -> tuple:
    """One random setting: (family, layers, hidden, policy, precision, micro-batch, seq, accumulation)."""
    return (
        rng.choice(FAMILIES), rng.randint(1, 3), rng.choice([32, 64, 128]), rng.choice(POLICIES),
        rng.choice(["fp32", "bf16"]), rng.randint(1, 4), rng.choice([8, 16, 32]), rng.randint(1, 2),
    )  # fmt: skip


def draws(n: int, seed: int, out: str | None) -> list[dict]:
    """``n`` seeded draws, each measured and predicted (``tests/integration/test_device_peak.measure``)."""
    from tests.integration.test_device_peak import measure

    rng, rows = random.Random(seed), []
    for _ in range(n):
        d = draw(rng)
        with tempfile.TemporaryDirectory() as t, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            measured, predicted = measure(t, *d)
        keys = ("family", "layers", "hidden", "policy", "precision", "micro_batch", "seq_len", "accum")
        rec = {"bench": "device_peak", "part": "draws", **dict(zip(keys, d)), "measured_bytes": measured}
        rec |= {"predicted_bytes": predicted, "predicted_over_measured": predicted / measured}
        emit(rec, out)
        rows.append(rec)
    return rows


def smollm2(out: str | None) -> list[dict]:
    """Real SmolLM2-135M through the CLI at each of ``BUDGETS``."""
    from fuyou.data.demo_corpus import write_demo_dataset
    from fuyou.run.demo import demo_model_dir

    work = tempfile.mkdtemp(prefix="fuyou-device-peak-")
    rows = []
    try:
        data, _ = write_demo_dataset(os.path.join(work, "data"))
        model = demo_model_dir()[0]
        for budget in BUDGETS:
            run_dir = os.path.join(work, budget)
            cmd = [sys.executable, "-m", "fuyou.cli.main", "finetune", model, "--data", data, "--output", run_dir]
            cmd += ["--steps", "3", "--seq-len", "256", "--micro-batch-size", "2", "--grad-accum", "2"]
            cmd += ["--precision", "fp32", "--cpu-memory", "1GiB", "--gpu-memory", budget, "--no-progress"]
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "FUYOU_CACHE": f"{work}/cache"})
            rec: dict = {"bench": "device_peak", "part": "smollm2", "gpu_memory": budget}
            if r.returncode:
                rec["refused"] = (r.stderr.strip().splitlines() or ["?"])[-1]
            else:
                run = json.loads(open(os.path.join(run_dir, "run.json")).read())
                rec |= {k: run.get(k) for k in ("device_peak_bytes", "device_predicted_bytes", "device_budget_bytes")}
                rec["planner_device_bytes"] = run["plan"].get("predicted_device_bytes")
                p = run["plan"]["plan"]
                rec["plan"] = {k: p.get(k) for k in ("grad_accum", "prefetch_depth", "expert_groups", "schedule")}
                rec["plan"]["policies"] = dict(Counter(p.get("activation_policy") or ["default"]))
                if rec["device_peak_bytes"] and rec["device_predicted_bytes"]:
                    rec["predicted_over_measured"] = rec["device_predicted_bytes"] / rec["device_peak_bytes"]
            rec["hardware"] = hardware_info([work])
            emit(rec, out)
            rows.append(rec)
            shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def meter(out: str | None) -> dict:
    """Microseconds an op: plain, under an empty dispatch mode, under the CPU backend's meter."""
    import contextlib
    import statistics
    import time

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from fuyou.device.cpu import CPUBackend

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    be, x, n = CPUBackend(1 << 34), torch.randn(64, 64), 2000

    def chain() -> None:
        y = x
        for _ in range(n):
            y = (y * 1.0001).relu()

    rec: dict = {"bench": "device_peak", "part": "meter", "ops": 2 * n}
    for name, ctx in (
        ("plain", contextlib.nullcontext),
        ("empty_mode", Empty),
        ("meter", lambda: be.counting("bench")),
    ):
        times = []
        for _ in range(7):
            with ctx():
                t = time.perf_counter()
                chain()
                times.append(time.perf_counter() - t)
        rec[f"{name}_us_per_op"] = statistics.median(times) / (2 * n) * 1e6
    rec["hardware"] = hardware_info()
    emit(rec, out)
    return rec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["draws", "smollm2", "meter", "both"], default="both")
    ap.add_argument("--draws", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="append the JSON lines to this file too")
    ap.add_argument("--smoke", action="store_true", help="two draws and the meter, no SmolLM2 run")
    a = ap.parse_args(argv)
    if a.smoke:
        a.draws = 2
        draws(a.draws, a.seed, a.out)
        meter(a.out)
        return
    if a.part in ("draws", "both"):
        rows = draws(a.draws, a.seed, a.out)
        ratios = sorted(r["predicted_over_measured"] for r in rows)
        inside = sum(1.0 <= x <= 1.1 for x in ratios)
        print(
            f"draws: predicted ÷ measured {ratios[0]:.2f}–{ratios[-1]:.2f}, median {ratios[len(ratios) // 2]:.2f}; "
            f"{inside}/{len(ratios)} within 1.0–1.1, {sum(x < 1.0 for x in ratios)} below 1.0",
            file=sys.stderr,
        )
    if a.part == "meter":
        r = meter(a.out)
        print(
            f"per op: plain {r['plain_us_per_op']:.1f} µs, empty mode {r['empty_mode_us_per_op']:.1f} µs, "
            f"meter {r['meter_us_per_op']:.1f} µs",
            file=sys.stderr,
        )
    if a.part in ("smollm2", "both"):
        for rec in smollm2(a.out):
            said = rec.get("refused") or (
                f"measured {rec['device_peak_bytes'] / 2**20:.1f} MiB, predicted "
                f"{rec['device_predicted_bytes'] / 2**20:.1f} MiB ({rec.get('predicted_over_measured', 0):.2f})"
            )
            print(f"SmolLM2 --gpu-memory {rec['gpu_memory']}: {said}", file=sys.stderr)


if __name__ == "__main__":
    main()
