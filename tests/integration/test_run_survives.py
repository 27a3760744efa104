"""A ``fuyou finetune`` run survives Ctrl-C, a scheduler's SIGTERM and a full disk: real CLI processes
are signalled mid-run; they checkpoint, print the exact resume command and exit 128 + the signal; that
command (``--resume auto``) then ends bit-identical to an uninterrupted run. A second Ctrl-C exits at
once and the resume is still exact. On a small real filesystem, a resume with ``--keep-checkpoints 1``
prunes the older checkpoints before it needs their room, and without it the run refuses up front,
naming what it needs and the fix."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fuyou.checkpoint import list_checkpoints
from tests.conftest import mounted
from tests.integration.test_data_parallel_cli import env_without_ranks, launch_ranks
from tests.integration.tiny_models import cli_inputs, exported_weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 10


@pytest.fixture(scope="module")
def model_data(tmp_path_factory):
    return cli_inputs(tmp_path_factory.mktemp("survive"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, model_data):
    """(model, data, an uninterrupted run's directory)."""
    model, data = model_data
    clean = str(tmp_path_factory.mktemp("clean") / "run")
    p = subprocess.run(
        [sys.executable, "-m", "fuyou", *args(model, data, clean)], cwd=ROOT, capture_output=True, text=True,
        timeout=600, env=env_without_ranks(),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return model, data, clean


def args(model: str, data: str, out: str, *extra: str) -> list[str]:
    return [
        "finetune", model, "--data", data, "--output", out, "--steps", str(STEPS), "--seq-len", "32",
        "--precision", "fp32", "--lr", "1e-3", "--cpu-memory", "256MiB", "--eval-fraction", "0.1",
        "--no-progress", *extra,
    ]  # fmt: skip


def losses(out: str) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fuyou", *argv], cwd=ROOT, env=env_without_ranks(), stderr=subprocess.PIPE, text=True
    )


def wait_for_steps(procs: list[subprocess.Popen], out: str, n: int) -> None:
    """Until ``out/metrics.jsonl`` has ``n`` steps (the processes still running)."""
    metrics, deadline = os.path.join(out, "metrics.jsonl"), time.time() + 300
    while not (os.path.exists(metrics) and len(open(metrics).readlines()) >= n):
        for p in procs:
            assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.02)


def resume_line(err: str) -> list[str]:
    """The resume command the run printed (the line after 'resume with')."""
    lines = err.splitlines()
    i = next(i for i, line in enumerate(lines) if "resume with" in line)
    cmd = shlex.split(lines[i + 1])
    assert cmd[0] == "fuyou" and cmd[-2:] == ["--resume", "auto"], cmd
    return cmd[1:]


def same_as_clean(out: str, clean: str) -> None:
    assert losses(out) == losses(clean)
    wc, wo = exported_weights(clean), exported_weights(out)
    assert wc.keys() == wo.keys() and all(torch.equal(wc[k], wo[k]) for k in wc)


def test_sigterm_checkpoints_prints_the_resume_command_and_it_finishes_the_run(tmp_path, model_data):
    """The default tier's check (~15 s); the slow tests below compare resumed runs with uninterrupted ones."""
    model, data = model_data
    out = str(tmp_path / "run")
    p = start(args(model, data, out))  # checkpoints are on by default (every 30 minutes): none yet
    wait_for_steps([p], out, 3)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err[-3000:]
    assert "SIGTERM received" in err and "Traceback" not in err, err[-3000:]
    done = len(losses(out))
    assert f"stopped on SIGTERM after step {done}" in err and done < STEPS, err[-3000:]
    assert list_checkpoints([os.path.join(out, "store")]) == [f"step-{done:08d}"]
    r = subprocess.run(
        [sys.executable, "-m", "fuyou", *resume_line(err)], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=env_without_ranks(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.load(open(os.path.join(out, "run.json")))["resumed_from_step"] == done
    assert len(losses(out)) == STEPS


@pytest.mark.slow  # ~25 s
def test_a_second_ctrl_c_exits_at_once_and_nothing_is_corrupted(tmp_path, inputs):
    model, data, clean = inputs
    out = str(tmp_path / "run")
    p = start(args(model, data, out, "--save-every", "1"))
    wait_for_steps([p], out, 4)
    p.send_signal(signal.SIGINT)
    time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "SIGINT again: exiting at once" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    r = subprocess.run(
        [sys.executable, "-m", "fuyou", *args(model, data, out, "--save-every", "1", "--resume", "auto")], cwd=ROOT,
        capture_output=True, text=True, timeout=600, env=env_without_ranks(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.load(open(os.path.join(out, "run.json")))["resumed_from_step"] >= 3
    same_as_clean(out, clean)


@pytest.mark.slow  # ~40 s
def test_under_two_ranks_one_signalled_rank_stops_both_at_one_step_and_the_resume_agrees(tmp_path, inputs):
    model, data, _ = inputs
    argv = args(model, data, "", "--micro-batch-size", "1", "--grad-accum", "2")
    clean, out = str(tmp_path / "clean"), str(tmp_path / "run")
    argv[argv.index("--output") + 1] = clean
    procs = launch_ranks(list(argv), 2)
    for q in procs:
        assert q.wait(timeout=600) == 0, q.communicate()[1][-3000:]
    argv[argv.index("--output") + 1] = out
    procs = launch_ranks(list(argv), 2)
    wait_for_steps(procs, out, 3)
    procs[1].send_signal(signal.SIGTERM)  # one rank only: the other learns it through the stop vote
    errs = [q.communicate(timeout=120)[1] for q in procs]
    assert [q.returncode for q in procs] == [143, 143], [e[-2000:] for e in errs]
    steps = {e.split("stopped on SIGTERM after step ")[1].split(";")[0] for e in errs}
    assert len(steps) == 1, steps  # both at the same step
    assert "resume with the same torchrun launch of:" in errs[0], errs[0][-2000:]
    done = int(steps.pop())
    for r in range(2):
        assert list_checkpoints([os.path.join(out, "store", f"rank{r}")])[0] == f"step-{done:08d}"
    procs = launch_ranks(resume_line(errs[0]), 2)
    for q in procs:
        assert q.wait(timeout=600) == 0, q.communicate()[1][-3000:]
    assert json.load(open(os.path.join(out, "run.json")))["resumed_from_step"] == done
    same_as_clean(out, clean)


def _ballast(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


def _fill(path: str) -> None:
    """Take all but 4 KiB of the filesystem of ``path``'s directory, as another program would, while the
    run keeps writing there (the free space measured can shrink before the allocation: measure again)."""
    import errno

    for _ in range(50):
        st = os.statvfs(os.path.dirname(path))
        try:
            _ballast(path, st.f_bavail * st.f_frsize - 4096)
            return
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    raise AssertionError(f"could not fill the filesystem of {path}")


def _keep_full(directory: str, proc: subprocess.Popen) -> list[str]:
    """Fill ``directory``'s filesystem, then take again whatever room it gets back (the run freeing a
    pruned checkpoint or a step's scratch files) until ``proc`` exits: another program that keeps
    writing. Without this, room freed after one fill at a lucky moment could let the run finish
    (seen once in CI). Returns the ballast files made, for the caller to remove."""
    made: list[str] = []
    while proc.poll() is None:
        st = os.statvfs(directory)
        if not made or st.f_bavail * st.f_frsize > 64 * 1024:
            made.append(os.path.join(directory, f"ballast{len(made)}"))
            _fill(made[-1])
        time.sleep(0.005)
    return made


@pytest.mark.root
@pytest.mark.slow  # ~30 s
def test_on_a_full_disk_keep_checkpoints_on_resume_prunes_before_it_needs_the_room(tmp_path, inputs):
    from fuyou.checkpoint.room import pins
    from fuyou.storage.store import TensorStore

    model, data, clean = inputs
    with mounted(str(tmp_path / "ssd"), "tmpfs", "size=600m") as ssd:
        out = str(tmp_path / "run")
        # the clean run's profile: no quick profile measured on (and filling) the small disk, the same plan
        common = ("--ssd", ssd, "--save-every", "1", "--profile", os.path.join(clean, "profile.json"))
        p = start(args(model, data, out, *common))
        wait_for_steps([p], out, 4)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=120) == 130
        assert len(list_checkpoints([ssd])) == 2
        with TensorStore.open([ssd]) as st:
            version = sum(os.stat(os.path.join(ssd, f)).st_blocks * 512 for _, f in st.committed()[1])
        used = sum(os.stat(os.path.join(ssd, f)).st_blocks * 512 for f in os.listdir(ssd) if f.endswith(".fy"))
        used += sum(p.nbytes for p in pins([ssd]))
        free = os.statvfs(ssd).f_bavail * os.statvfs(ssd).f_frsize
        _ballast(os.path.join(ssd, "ballast"), free - int(3.5 * version - used))  # room for 3 versions, not 4

        r = subprocess.run(
            [sys.executable, "-m", "fuyou", *args(model, data, out, *common, "--resume", "auto")], cwd=ROOT,
            capture_output=True, text=True, timeout=600, env=env_without_ranks(),
        )  # fmt: skip
        line = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 1 and line.startswith("error: not enough room for checkpoints"), r.stderr[-3000:]
        assert "--keep-checkpoints 1" in line and "Traceback" not in r.stderr, line

        r = subprocess.run(
            [sys.executable, "-m", "fuyou", *args(model, data, out, *common, "--resume", "auto", "--keep-checkpoints", "1")],
            cwd=ROOT, capture_output=True, text=True, timeout=600, env=env_without_ranks(),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(list_checkpoints([ssd])) == 1
        same_as_clean(out, clean)


@pytest.mark.slow  # ~50 s
def test_ctrl_c_in_torchruns_terminal_stops_every_rank_at_one_step_and_the_resume_is_exact(tmp_path, inputs):
    """The terminal's SIGINT reaches torchrun and both ranks (one process group); torchrun then sends
    its workers SIGTERM, which must not cut their checkpoint short."""
    model, data, _ = inputs
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fuyou"]
    clean, out = str(tmp_path / "clean"), str(tmp_path / "run")
    mb = ("--micro-batch-size", "1", "--grad-accum", "2")
    p = subprocess.run(
        launch + args(model, data, clean, *mb), cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=env_without_ranks(),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.Popen(
        launch + args(model, data, out, *mb), cwd=ROOT, env=env_without_ranks(), stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    wait_for_steps([p], out, 3)
    os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0, err[-3000:]  # torchrun itself ends with its own SignalException traceback
    stops = {line.split("after step ")[1].split(";")[0] for line in err.splitlines() if "stopped on SIGINT" in line}
    assert len(stops) == 1 and err.count("stopped on SIGINT") == 2, err[-3000:]  # both ranks, one step
    done = int(stops.pop())
    for r in range(2):
        assert list_checkpoints([os.path.join(out, "store", f"rank{r}")])[0] == f"step-{done:08d}"
    r = subprocess.run(
        launch + resume_line(err), cwd=ROOT, capture_output=True, text=True, timeout=600, env=env_without_ranks()
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.load(open(os.path.join(out, "run.json")))["resumed_from_step"] == done
    same_as_clean(out, clean)


@pytest.mark.slow  # ~10 s
def test_with_checkpoints_off_a_signal_only_stops_and_says_nothing_was_saved(tmp_path, model_data):
    model, data = model_data
    out = str(tmp_path / "run")
    p = start(args(model, data, out, "--save-every", "0"))
    wait_for_steps([p], out, 2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err[-3000:]
    assert "nothing saved (checkpoints are off: --save-every 0)" in err and "resume with" not in err, err[-3000:]
    assert list_checkpoints([os.path.join(out, "store")]) == []


@pytest.mark.root
@pytest.mark.slow  # ~25 s
def test_a_disk_that_fills_mid_run_names_what_the_checkpoints_pin_and_nothing_is_lost(tmp_path, inputs):
    model, data, clean = inputs
    with mounted(str(tmp_path / "ssd"), "tmpfs", "size=600m") as ssd:
        out = str(tmp_path / "run")
        common = ("--ssd", ssd, "--save-every", "1", "--profile", os.path.join(clean, "profile.json"))
        p = start(args(model, data, out, *common))
        wait_for_steps([p], out, 3)
        with ThreadPoolExecutor(1) as pool:
            ballast = pool.submit(_keep_full, ssd, p)  # another program fills it, and keeps it full
            try:
                _, err = p.communicate(timeout=120)
            finally:
                if p.poll() is None:  # a run that never stops must not leave _keep_full waiting on it
                    p.kill()
                    p.wait()
            made = ballast.result()
        line = err.strip().splitlines()[-1]
        assert p.returncode == 1 and line.startswith("error: disk full"), err[-3000:]
        assert "checkpoint(s) pin" in line and "MiB the live store no longer uses: step-" in line, line
        assert "Traceback" not in err, err[-3000:]
        for path in made:
            os.unlink(path)
        r = subprocess.run(
            [sys.executable, "-m", "fuyou", *args(model, data, out, *common, "--resume", "auto")], cwd=ROOT,
            capture_output=True, text=True, timeout=600, env=env_without_ranks(),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        same_as_clean(out, clean)
