"""The bench scripts' --smoke modes run (so the full benches do not rot)."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

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


def test_gpu_bench_smoke_runs_on_any_device(tmp_path):
    r = subprocess.run(
        [sys.executable, "bench/bench_gpu.py", "--smoke", "--ssd", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout.splitlines()[-1])
    assert rec["tflops"] > 0 and 0 < rec["mfu"] and rec["flop_formula"]


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
