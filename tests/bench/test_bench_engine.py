"""The engine benches' --smoke modes run (P1, P2, trace; P5) and print the figures they promise."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(script: str, tmp_path) -> list[dict]:
    r = subprocess.run(
        [sys.executable, script, "--smoke", "--dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # ~13 s
def test_engine_bench_smoke(tmp_path):
    recs = run_bench("bench/bench_engine.py", tmp_path)
    kinds = [r["bench"] for r in recs]
    assert kinds.count("engine_p2") == 2 and kinds.count("engine_trace") == 1  # keep and recompute
    assert kinds.count("engine_p1") == 3  # compute-bound from each p2 variant, plus the ssd-bound run
    for r in recs:
        assert r["hardware"]["cores"] >= 1 and r["smoke"]
    for r in (r for r in recs if r["bench"] == "engine_p2"):
        assert r["ratio"] > 0 and math.isfinite(r["ratio"])
        assert all(math.isfinite(x) for x in r["loss_all"]["fuyou"])
    # same initial weights and batch: the first Fuyou step's loss is the reference's (fp32)
    first = next(r for r in recs if r["bench"] == "engine_p2")
    assert math.isclose(first["loss_first_step"]["fuyou"], first["loss_first_step"]["ref"], rel_tol=1e-5)
    for r in (r for r in recs if r["bench"] == "engine_p1"):
        assert r["p1_merged_median"] >= 1.0 - 1e-9 and r["p1_raw_median"] >= r["p1_merged_median"] - 1e-9
        assert set(r["busy_merged_s_median"]) == {"cpu", "ssd"}
    trace = next(r for r in recs if r["bench"] == "engine_trace")
    assert trace["spans"] > 0 and all(
        trace["spans_per_resource"][k] > 0 for k in ("ssd_read", "ssd_write", "compute", "adam")
    )
    assert not os.listdir(tmp_path)  # stores cleaned up


@pytest.mark.slow  # 8.5 s
def test_scale_bench_smoke(tmp_path):
    (r,) = run_bench("bench/bench_scale.py", tmp_path)
    assert r["bench"] == "scale_p5" and r["state_over_budget"] >= 10.0
    assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
    assert all(s["applied"] for s in r["steps"])
    assert r["rss_peak_ru_maxrss_bytes"] >= r["rss_baseline_after_imports_bytes"] > 0
    assert r["host_pool_reserved_bytes"] <= r["host_budget_bytes"]
    # clipping on (the CLI default): at state ÷ 10 the parked gradients do not all fit: most wait on SSD
    assert r["max_grad_norm"] > 0 and r["plan"]["schedule"] == "overlap_next_forward"
    assert r["plan"]["effective"]["park_ram_blocks"] < r["model"]["blocks"]
    assert not os.listdir(tmp_path)


@pytest.mark.slow  # ~25 s: two launches of local ranks
def test_data_parallel_bench_smoke(tmp_path):
    recs = run_bench("bench/bench_data_parallel.py", tmp_path)
    assert [r["ranks"] for r in recs] == [1, 2] and all(r["smoke"] for r in recs)
    one, two = recs
    assert one["comm_bytes_per_rank"] == 0 < two["comm_bytes_per_rank"]
    assert 0.45 < two["ssd_share_max_rank"] < 0.6  # each rank moves about half of one process's bytes
    assert two["step_s"] > 0 and math.isfinite(two["step_ratio"])


@pytest.mark.slow  # ~15 s: three trainers on a tiny model
def test_lora_bench_smoke(tmp_path):
    recs = run_bench("bench/bench_lora.py", tmp_path)
    by = {r["trainer"]: r for r in recs}
    assert set(by) == {"fuyou_full", "fuyou_lora", "plain_lora"} and all(r["smoke"] for r in recs)
    assert by["fuyou_lora"]["ssd_write_bytes_per_step"] == 0 < by["fuyou_full"]["ssd_write_bytes_per_step"]
    assert 0 < by["fuyou_lora"]["ssd_read_bytes_per_step"] < by["fuyou_full"]["ssd_read_bytes_per_step"]
    assert 0 < by["fuyou_lora"]["lora_params"] < by["fuyou_lora"]["params"]
    assert all(math.isfinite(r["vs_fuyou_full"]) and r["step_s_median"] > 0 for r in recs)
    assert not os.listdir(tmp_path)
