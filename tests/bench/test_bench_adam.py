"""The Adam benches' --smoke modes run and print the records RESULTS-adam.md is built from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(script: str) -> list[dict]:
    r = subprocess.run([sys.executable, f"bench/{script}", "--smoke"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # ~5 s
def test_bench_adam_smoke() -> None:
    recs = run_bench("bench_adam.py")
    assert "cpu" in recs[0]["hardware"]
    cases = {r["case"] for r in recs if "case" in r}
    assert {"numba_fuyou", "numba_fp32grad", "torch_fused", "stream28", "copy_numba"} <= cases
    summary = next(r for r in recs if r.get("summary"))
    assert summary["numba_fuyou_Gparams_per_s"] > 0 and summary["ratio_vs_best"] > 0
    assert summary["copy_GBps"] > 0 and summary["best_baseline"] == "torch_fused"


@pytest.mark.slow  # 9 s
def test_bench_bf16_state_smoke() -> None:
    recs = run_bench("bench_adam_bf16_state.py")
    summary = next(r for r in recs if r.get("summary"))
    assert set(summary["final_train_loss"]) == {"fp32", "bf16", "fp32_reseed"}
    losses = list(summary["final_heldout_loss"].values())
    assert all(0 < x < 6.0 for x in losses)  # below ln(256) = 5.55 + margin: it trains, no NaN
    assert summary["bf16_minus_fp32_train"] != 0.0  # the bf16 state really was used
