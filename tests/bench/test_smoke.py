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


def smoke_record(script: str, tmp_path) -> dict:
    """Run ``bench/<script> --smoke --dir tmp_path``; its last JSON line (fails the test on a non-zero exit)."""
    r = subprocess.run(
        [sys.executable, f"bench/{script}", "--smoke", "--dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.slow  # ~11 s; .ci/run runs `bench_store.py --smoke` itself before the tests
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


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_reference_takes_the_engine_this_fio_has(tmp_path, monkeypatch):
    """A fio without libaio (the static build carried to the GPU machine) is run with the next engine it
    lists; the real fio here, with libaio left out of its engine list by a wrapper on PATH."""
    from bench.bench_store import Fio

    real = shutil.which("fio")
    wrapper = tmp_path / "bin" / "fio"
    wrapper.parent.mkdir()
    wrapper.write_text(
        f'#!/bin/sh\nif [ "$1" = --enghelp ]; then "{real}" --enghelp | grep -vx "[[:space:]]*libaio"; exit 0; fi\n'
        f'case "$*" in *--ioengine=libaio*) exit 1;; esac\nexec "{real}" "$@"\n'
    )
    wrapper.chmod(0o755)
    (tmp_path / "d").mkdir()
    assert Fio(str(tmp_path / "d")).engine == "libaio"
    monkeypatch.setenv("PATH", f"{wrapper.parent}:{os.environ['PATH']}")
    ref = Fio(str(tmp_path / "d"))
    assert ref.engine in ("io_uring", "posixaio") and ref("write", 8, 2) > 0


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


@pytest.mark.slow  # ~8 s
def test_checkpoint_bench_smoke(tmp_path):
    rec = smoke_record("bench_checkpoint.py", tmp_path)
    assert rec["link_s_median"] > 0 and len(rec["disk_bytes_after_each"]) == 2


@pytest.mark.slow  # fixed ~7 s, auto ~16 s (a planner run)
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


def test_gpu_bench_refuses_to_fall_back_to_the_cpu(monkeypatch, capsys):
    """Without CUDA, bench_gpu.py stops with one line naming ``--allow-cpu`` (which, like ``--smoke``,
    lets it run on the CPU backend) instead of measuring the CPU as if it were the GPU."""
    from bench import bench_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench_gpu.pick_device(bench_gpu.parse(["--layers", "2"]))
    msg = str(e.value.code)
    assert "\n" not in msg and "CUDA is not available" in msg and "--allow-cpu" in msg
    assert bench_gpu.pick_device(bench_gpu.parse(["--allow-cpu"])) == "cpu"
    assert bench_gpu.pick_device(bench_gpu.parse(["--smoke"])) == "cpu"


def test_gpu_bench_writes_its_line_before_the_store_closes(tmp_path, monkeypatch):
    """The result line is in ``--out`` before the engine closes (a close that fails, on a full disk say,
    must not lose the measurement); the bench's store is thrown away, so close does not write it back."""
    from bench import bench_gpu
    from fuyou.engine import Engine

    out, seen = tmp_path / "figures.jsonl", []
    close = Engine.close

    def spy(self, persist=True):
        seen.append([json.loads(line)["bench"] for line in out.read_text().splitlines()] if out.exists() else [])
        seen.append(persist)
        close(self, persist)

    monkeypatch.setattr(Engine, "close", spy)
    bench_gpu.main(["--smoke", "--steps", "1", "--ssd", str(tmp_path), "--out", str(out)])
    assert seen == [["gpu_throughput"], False]


def test_junit_skips_other_than_a_missing_package_are_found(tmp_path):
    """What the first-contact script's test stage fails on: a GPU test skipped for any reason but a
    missing optional package."""
    from bench.common import unexpected_skips

    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.a" name="ok"/>'
        '<testcase classname="tests.gpu.a" name="kv"><skipped type="pytest.skip" message="kvikio not installed"/>'
        "</testcase>"
        '<testcase classname="tests.gpu.a" name="gpu"><skipped type="pytest.skip" message="needs a CUDA GPU"/>'
        "</testcase></testsuite></testsuites>"
    )
    assert unexpected_skips(str(xml)) == (3, 2, ["tests.gpu.a.gpu: needs a CUDA GPU"])
    assert unexpected_skips(str(xml), ("not installed", "needs a CUDA GPU")) == (3, 2, [])


FIRST_CONTACT = os.path.join(ROOT, "bench", "gpu_first_contact.sh")
TINY = "--layers 2 --hidden 128 --ffn 256 --vocab 512 --seq 64 --micro-batch 2 --grad-accum 2"
REHEARSAL_CAPS = {  # each stage's cap scaled down from the GPU run's (first: 480 s in all, second: 390, again: 450)
    "first": {"env": 15, "install": 30, "tests": 60, "p6": 60, "store": 30},
    "second": {"env": 15, "install": 30, "ssd": 45, "formats": 60, "profile": 45},
    "again": {"env": 15, "install": 30, "tests": 60, "store": 30, "ssd": 45, "profile": 45},
}


def tiny_wheel(d) -> str:
    """A one-module wheel (``fc_rehearsal``): what the install stage puts in its ``--target``."""
    import zipfile

    d.mkdir()
    path = d / "fc_rehearsal-0.1-py3-none-any.whl"
    di = "fc_rehearsal-0.1.dist-info"
    files = {
        "fc_rehearsal.py": "VERSION = '0.1'\n",
        f"{di}/METADATA": "Metadata-Version: 2.1\nName: fc-rehearsal\nVersion: 0.1\n",
        f"{di}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{di}/RECORD", "".join(f"{n},," + "\n" for n in [*files, f"{di}/RECORD"]))
    return str(d)


def first_contact(tmp_path, mode: str, **env) -> tuple[subprocess.CompletedProcess, float]:
    import time

    full = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / f"out-{mode}"),
        "FUYOU_SCRATCH": str(tmp_path / "scratch"),
        "FC_SITE": str(tmp_path / "site"),
        "FC_WHEELS": str(tmp_path / "no-wheels"),
        "FC_SCRATCH_NEED_GIB": "0.1",
        **env,
    }
    t0 = time.perf_counter()
    r = subprocess.run(["bash", FIRST_CONTACT, mode], cwd=ROOT, env=full, capture_output=True, text=True, timeout=400)
    return r, time.perf_counter() - t0


def summary(out) -> dict[str, dict[str, str]]:
    lines = (out / "summary.txt").read_text().splitlines()
    rows = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in lines]
    return {row["stage"]: row for row in rows}


@pytest.mark.slow  # ~65 s on 2 cores: both modes, tiny shapes; pytest of tests/gpu (all skip); 3 early stops
def test_gpu_first_contact_rehearses_on_a_cpu(tmp_path):
    """bench/gpu_first_contact.sh, the lent GPU's first call (and its second), on this CPU with tiny
    shapes and every stage's cap scaled down: each stage ends inside its cap with exit code 0, the
    figures are appended as measured, at most 8 files come back; without CUDA (no rehearsal variable)
    or without room on the scratch disk it stops at once with one line; a stage whose cap no longer
    fits the deadline is skipped with its summary line."""
    if not torch.cuda.is_available():  # no CUDA and no FUYOU_REHEARSAL: the first stage stops the run
        r, dt = first_contact(tmp_path, "first", FUYOU_REHEARSAL="0")
        assert r.returncode == 3 and dt < 60, (r.returncode, dt, r.stderr)
        (line,) = r.stderr.strip().splitlines()
        assert "CUDA is not available" in line and "FUYOU_REHEARSAL=1" in line
        assert list(summary(tmp_path / "out-first")) == ["env"]
        shutil.rmtree(tmp_path / "out-first")
    r, dt = first_contact(tmp_path, "first", FUYOU_REHEARSAL="1", FC_SCRATCH_NEED_GIB="1000000")
    assert r.returncode == 3 and dt < 60, (r.returncode, dt, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert "GiB free" in line and "FUYOU_SCRATCH" in line
    shutil.rmtree(tmp_path / "out-first")
    caps = dict(FC_DEADLINE_S="25", FC_CAP_ENV="10", FC_CAP_INSTALL="1")
    r, dt = first_contact(tmp_path, "first", FUYOU_REHEARSAL="1", **caps)
    rows = summary(tmp_path / "out-first")  # env fits; install is killed at its 1 s; the others no longer fit
    assert r.returncode == 1 and rows.pop("env")["rc"] == "0" and dt < 45, (r.returncode, dt, r.stderr)
    assert rows.pop("install")["rc"] == "124" and "timed_out" in (tmp_path / "out-first" / "summary.txt").read_text()
    assert list(rows) == ["tests", "p6", "store"] and {row["rc"] for row in rows.values()} == {"skipped"}
    shutil.rmtree(tmp_path / "out-first")

    caps = {f"FC_CAP_{stage.upper()}": str(cap) for mode in REHEARSAL_CAPS.values() for stage, cap in mode.items()}
    shapes = dict(
        P6_SHAPE=TINY, P6_CPU="512MiB", P6_OOC_CPU="48MiB", P6_OOC_GPU="64MiB", P6_STEPS="2", P6_OOC_STEPS="1",
        STORE_MIB="64", STORE_REPEATS="1", SSD_SHAPE=TINY, SSD_CPU="48MiB", SSD_GPU="64MiB", PROF_SHAPE=TINY,
        PROF_CPU="512MiB",
    )  # fmt: skip
    wheels = tiny_wheel(tmp_path / "wheels")
    for mode, deadline in (("first", 240), ("second", 220), ("again", 240)):
        env = dict(FUYOU_REHEARSAL="1", FC_DEADLINE_S=str(deadline), FC_WHEELS=wheels, **caps, **shapes)
        r, dt = first_contact(tmp_path, mode, **env)
        out = tmp_path / f"out-{mode}"
        log = (out / f"{mode}.log").read_text()
        assert r.returncode == 0 and r.stderr == "", (r.stderr[-2000:], log[-4000:])
        rows = summary(out)
        assert list(rows) == list(REHEARSAL_CAPS[mode]), rows
        for stage, cap in REHEARSAL_CAPS[mode].items():
            assert rows[stage]["rc"] == "0" and int(rows[stage]["cap"]) == cap, rows[stage]
            assert int(rows[stage]["seconds"]) <= cap, rows[stage]
        assert dt < deadline
        files = [p for p in out.rglob("*") if p.is_file()]
        assert len(files) <= 8 and {p.name for p in files} >= {"summary.txt", "figures.jsonl", f"{mode}.log"}
        recs = [json.loads(line) for line in (out / "figures.jsonl").read_text().splitlines()]
        by = {(rec["bench"], rec.get("run", rec.get("num"))): rec for rec in recs}
        assert by["env", None]["rehearsal"] and by["env", None]["scratch"] == str(tmp_path / "scratch")
        assert by["install", None]["fuyou"] == os.path.join(ROOT, "fuyou")
        if mode == "first":
            assert "installing 1 wheels" in log and (tmp_path / "site" / "fc_rehearsal.py").exists()
            plain, fuyou, ooc = (
                by["gpu_plain", "plain"],
                by["gpu_throughput", "fuyou"],
                by["gpu_throughput", "fuyou_ooc"],
            )
            assert plain["tokens_per_step"] == fuyou["tokens_per_step"] == 256 and plain["tflops"] > 0
            assert plain["flop_formula"] == fuyou["flop_formula"] and fuyou["step_over_busiest"] >= 1.0
            threads = by["gpu_throughput", "fuyou_adam1"]  # the planner's plan, Adam on 1 thread (2 cores - 4)
            assert threads["adam_threads"] == 1 and threads["plan"] == fuyou["plan"]
            keep = by["gpu_throughput", "fuyou_keep"]  # the planner's plan, every layer's activations kept
            assert keep["layer_policy"] == "keep" and "predicted_step_s" not in keep
            assert {k: v for k, v in keep["plan"].items() if k != "activation_policy"} == {
                k: v for k, v in fuyou["plan"].items() if k != "activation_policy"
            }
            ratio = [rec for rec in recs if rec["bench"] == "gpu_ratio" and rec["num"] == "fuyou"]
            assert ratio[0]["den"] == "plain"
            assert ratio[0]["step_time_ratio"] == pytest.approx(fuyou["step_s_median"] / plain["step_s_median"])
            assert ooc["cpu_memory"] == "48MiB" and ooc["backend_memory"]["capacity"] == 64 << 20
            assert [rec["bench"] for rec in recs].index("gpu_ratio") < [rec["bench"] for rec in recs].index(
                "store_vs_fio"
            )
            assert by["store_direct", None]["o_direct"] and ("store_vs_fio", None) in by
            assert (out / "junit-gpu.xml").exists() and (out / "trace-p6.json.gz").stat().st_size > 0
            assert "pytest-timeout" in log or "--timeout" not in log
        else:
            assert "installed in" in log and "already" in log  # the same wheels: no second pip run
            assert by["gpu_throughput", "ssd_bound"]["predicted_over_measured"] > 0
            assert by["gpu_throughput", "ssd_bound"]["optimizer_state"] == "fp32"
            if mode == "second":  # the ssd stage's point under the other state formats
                formats = {f: by["gpu_throughput", f"ssd_bound_{f}"]["optimizer_state"] for f in ("int8", "split")}
                assert formats == {"int8": "int8", "split": "split"}
            check = by["gpu_profile_check", "profiled"]
            assert check["timeline_compute_busy_s"] > 0 and check["step_s"] > 0
            assert (out / "trace-profile.json.gz").stat().st_size > 0


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


@pytest.mark.slow  # ~30 s: two real CLI runs of a tiny model, the first measuring a quick profile
def test_plan_truth_bench_smoke(tmp_path):
    """Predicted ÷ measured through the CLI: one record per setting, each with both step times and the
    run's own verdict on its profile."""
    out = tmp_path / "truth.jsonl"
    r = subprocess.run(
        [sys.executable, "bench/bench_plan_truth.py", "--smoke", "--dir", str(tmp_path), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["setting"] for rec in recs] == ["ssd_noclip_fp32", "lora8"]
    assert all(rec["predicted_over_measured"] > 0 and rec["profile_check"]["verdict"] for rec in recs), recs
    spans = [rec["compute_spans_ms"] for rec in recs]  # where the last step's compute went, beside the profile
    assert all(s["fwd layer"]["median_ms"] > 0 and s["fwd layer"]["profile_ms"] > 0 for s in spans), spans
    assert spans[0]["bwd layer"]["n"] == spans[0]["fwd layer"]["n"] > 0 and spans[1]["bwd layer"]["profile_ms"] > 0


@pytest.mark.slow  # 7.5 s
def test_device_peak_bench_smoke():
    """Predicted and measured device peaks of two random draws, and the allocation meter's cost per op."""
    r = subprocess.run(
        [sys.executable, "bench/bench_device_peak.py", "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    draws = [x for x in recs if x["part"] == "draws"]
    assert len(draws) == 2 and all(x["measured_bytes"] > 0 and x["predicted_over_measured"] > 0 for x in draws)
    (m,) = [x for x in recs if x["part"] == "meter"]
    assert 0 < m["plain_us_per_op"] < m["meter_us_per_op"]


@pytest.mark.slow  # ~9 s
def test_io_share_bench_smoke(tmp_path):
    """A layer alone and beside the store's I/O stream: the I/O path's CPU per byte, the compute lost and
    what the cost model charges for it, per round."""
    rec = smoke_record("bench_io_share.py", tmp_path)
    assert rec["io_cpu_s_per_gb"] > 0 and len(rec["rounds"]) == 1
    row = rec["rounds"][0]
    assert row["alone_ms"] > 0 and row["beside_ms"] > 0 and row["io_MBps"] > 0 and row["charged_ms"] > 0
    assert os.listdir(tmp_path) == []  # the store's files are gone
