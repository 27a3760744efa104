"""The bench scripts' --smoke modes run (so the full benches do not rot)."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER = os.path.join(os.path.dirname(ROOT), "shared", "peers", "deepspeed_baseline.py")


def test_store_bench_smoke(tmp_path):
    """Two I/O engines side by side (pyfile stands in for kvikio, which cannot do I/O without a CUDA
    driver): each has its own GB/s, CPU-seconds per GB and ratios to fio and to the first engine."""
    r = subprocess.run(
        [sys.executable, "bench/bench_store.py", "--smoke", "--dir", str(tmp_path), "--io", "posix,pyfile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    by = {(rec["io"], rec["op"]): rec for rec in recs}
    assert set(by) == {(io, op) for io in ("posix", "pyfile") for op in ("write", "read", "commit")}
    for io in ("posix", "pyfile"):
        for op in ("write", "read"):  # with fio: both ratios measured; without: reported as not measured (NaN)
            rec = by[io, op]
            assert rec["store_GBps"] > 0 and rec["store_cpu_s_per_GB"] > 0, (io, op)
            for key in ("ratio", "ratio_store_qd"):
                assert (rec[key] > 0) if shutil.which("fio") else math.isnan(rec[key]), (io, op, key, rec[key])
    assert by["pyfile", "read"]["ratio_vs_posix"] > 0 and "ratio_vs_posix" not in by["posix", "read"]


def test_store_bench_refuses_an_engine_it_cannot_run(tmp_path):
    """``--io kvikio`` without a CUDA driver (or an unknown engine) is one line and a non-zero exit."""
    from fuyou.storage.io_kvikio import kvikio_usable

    engine = "nonesuch" if kvikio_usable() else "kvikio"
    r = subprocess.run(
        [sys.executable, "bench/bench_store.py", "--smoke", "--dir", str(tmp_path), "--io", f"posix,{engine}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and engine in r.stderr, r.stderr


def test_checkpoint_bench_smoke(tmp_path):
    r = subprocess.run(
        [sys.executable, "bench/bench_checkpoint.py", "--smoke", "--dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout.splitlines()[-1])
    assert rec["link_s_median"] > 0 and len(rec["disk_bytes_after_each"]) == 2


@pytest.mark.parametrize("plan", ["fixed", "auto"])
def test_gpu_bench_smoke_runs_on_any_device(tmp_path, plan):
    """P6 on a tiny model; with the planner's plan (``auto``) it also records predicted ÷ measured (P7)."""
    r = subprocess.run(
        [sys.executable, "bench/bench_gpu.py", "--smoke", "--ssd", str(tmp_path), "--plan", plan],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout.splitlines()[-1])
    assert rec["tflops"] > 0 and 0 < rec["mfu"] and rec["flop_formula"]
    if plan == "auto":
        assert rec["source"] == "planner" and rec["predicted_over_measured"] > 0
        assert rec["predicted_step_s"] == pytest.approx(rec["predicted_over_measured"] * rec["step_s_median"])
    else:
        assert "predicted_step_s" not in rec and rec["plan"]["activation_policy"][1] == "recompute"


@pytest.mark.slow  # ~45 s on 2 cores: pytest's collection of the whole suite, a store bench, three tiny runs
def test_gpu_suite_rehearses_on_any_machine(tmp_path):
    """bench/gpu_suite.sh (the GPU run in one command) runs its stages on a machine without a GPU too:
    the GPU tests skip, kvikio is left out with a note, the benches run on the CPU backend."""
    tiny = "--layers 2 --hidden 128 --ffn 256 --vocab 512 --seq 64 --micro-batch 1 --grad-accum 2 --steps 2"
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "FUYOU_SUITE_DIR": str(tmp_path / "work"),
        "PYTHON": sys.executable,
        "STORE_MIB": "128",
        "P7_SHAPE": tiny,
        "P7_BUDGETS": "512MiB 96MiB",
    }
    stages = ["env", "tests", "store", "p6-smoke", "p7"]
    r = subprocess.run(
        ["bash", "bench/gpu_suite.sh", *stages], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    out = tmp_path / "out"
    assert r.returncode == 0, (r.stdout, (out / "suite.log").read_text()[-3000:])
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == stages and all(": ok (" in line for line in summary)
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(rec["io"], rec["op"]) for rec in recs if rec["bench"] == "store_vs_fio"} >= {("posix", "read")}
    runs = [rec for rec in recs if rec["bench"] == "gpu_throughput"]
    assert len(runs) == 3 and all(rec["predicted_over_measured"] > 0 for rec in runs[1:])
    assert "kvikio usable" in (out / "env.txt").read_text() and (out / "trace-smoke.json.gz").stat().st_size > 0
    if not torch.cuda.is_available():  # every GPU test collected, and skipped
        assert 'skipped="0"' not in (out / "junit-gpu.xml").read_text()


@pytest.mark.slow  # ~35 s: the peer script's plain run imports transformers in its own process
def test_io_cpu_bench_smoke(tmp_path):
    """CPU seconds per GB per stage, read from the engine's own I/O, and Fuyou ÷ plain from the peer script."""
    r = subprocess.run(
        [sys.executable, "bench/bench_io_cpu.py", "--smoke", "--dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout.splitlines()[-1])
    stages = rec["fuyou"]["stages"]
    for key in ("weights.read", "weights.write", "state.read", "state.write"):
        assert stages[key]["gb_per_step"] > 0 and stages[key]["cpu_s_per_gb"] > 0, key
    assert rec["fuyou"]["threads_cpu_s_per_step"]["io_pool"] > 0
    if os.path.exists(PEER):  # the peer script lives beside the repository on development machines only
        assert rec["references"]["plain"]["median_step_s"] > 0 and rec["ratios"]["fuyou_over_plain"] > 0
        assert 1.0 <= rec["ratios"]["cpu_floor_over_plain"] <= rec["ratios"]["fuyou_over_plain"] * 1.1
    else:
        assert rec["references"] == {} and rec["ratios"] == {}
