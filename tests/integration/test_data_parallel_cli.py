"""``fuyou finetune`` under torchrun: N ranks train what one process trains on the same global batch;
a rank SIGKILLed mid-run makes the others exit with a clear message; ``--resume auto`` on every rank
then ends bit-identical to an uninterrupted N-rank run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from fuyou.storage.manifest import MANIFEST
from tests.integration.test_data_parallel import free_port
from tests.integration.tiny_models import cli_inputs, exported_weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    return cli_inputs(tmp_path_factory.mktemp("dp"))


def finetune_args(model: str, data: str, out: str, mb: int, K: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "finetune", model, "--data", data, "--output", out, "--steps", str(STEPS), "--seq-len", "32",
        "--micro-batch-size", str(mb), "--grad-accum", str(K), "--precision", "fp32", "--lr", "1e-3",
        "--cpu-memory", "256MiB", "--eval-fraction", "0", "--no-progress", *extra,
    ]  # fmt: skip


def env_without_ranks(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return env | {"FUYOU_COLLECTIVE_TIMEOUT": "60"} | extra


def losses(out: str) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.mark.slow  # ~30 s: the default tier is at its 10-minute budget
def test_torchrun_two_ranks_train_what_one_process_trains(tmp_path, model_and_data) -> None:
    model, data = model_and_data
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    cmd = [sys.executable, "-m", "fuyou"] + finetune_args(model, data, one, 1, 4)  # the CLI's defaults otherwise
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600, env=env_without_ranks())
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fuyou"]
    p = subprocess.run(
        run + finetune_args(model, data, two, 1, 2), cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=env_without_ranks(),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    w1, w2 = exported_weights(one), exported_weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-5, msg=k)
    with open(os.path.join(two, "run.json")) as f:
        summary = json.load(f)
    assert summary["ranks"] == 2 and summary["tokens"] == json.load(open(os.path.join(one, "run.json")))["tokens"]
    for r in range(2):  # each rank's own store
        assert os.path.isfile(os.path.join(two, "store", f"rank{r}", MANIFEST))


def launch_ranks(args: list[str], world: int, **env: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for r in range(world):
        e = env_without_ranks(**env) | dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world))
        e |= dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(
            subprocess.Popen([sys.executable, "-m", "fuyou"] + args, cwd=ROOT, env=e, stderr=subprocess.PIPE, text=True)
        )
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> None:
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]


@pytest.mark.slow  # ~1.5 min
def test_a_killed_rank_stops_the_others_and_resume_is_bit_identical(tmp_path, model_and_data) -> None:
    model, data = model_and_data
    ckpt = ("--save-every", "1", "--keep-checkpoints", "2", "--resume", "auto", "--max-grad-norm", "1.0")
    clean, killed = str(tmp_path / "clean"), str(tmp_path / "killed")
    finish(launch_ranks(finetune_args(model, data, clean, 1, 2, ckpt), 2))
    procs = launch_ranks(finetune_args(model, data, killed, 1, 2, ckpt), 2)
    metrics = os.path.join(killed, "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and not (os.path.exists(metrics) and len(open(metrics).readlines()) >= 3):
        assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
        time.sleep(0.05)
    procs[1].kill()  # SIGKILL, in the middle of a step
    t0 = time.time()
    _, err = procs[0].communicate(timeout=120)
    assert procs[0].returncode != 0 and time.time() - t0 < 90
    assert "another rank of this run stopped" in err, err[-3000:]
    procs[1].communicate()
    finish(launch_ranks(finetune_args(model, data, killed, 1, 2, ckpt), 2))
    with open(os.path.join(killed, "run.json")) as f:
        assert json.load(f)["resumed_from_step"] >= 2  # from the last checkpoint every rank held
    assert losses(killed) == losses(clean)
    wc, wk = exported_weights(clean), exported_weights(killed)
    assert wc.keys() == wk.keys() and all(torch.equal(wc[k], wk[k]) for k in wc)


@pytest.mark.slow  # ~35 s
def test_fuyou_export_of_a_two_rank_run_directory(tmp_path, model_and_data) -> None:
    """``fuyou export RUN_DIR`` puts every rank's shards together: the same model the run exported."""
    model, data = model_and_data
    out = str(tmp_path / "run")
    finish(launch_ranks(finetune_args(model, data, out, 1, 1, ("--steps", "2")), 2))
    again = str(tmp_path / "again")
    p = subprocess.run(
        [sys.executable, "-m", "fuyou", "export", out, os.path.join(again, "model"), "--dtype", "fp32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env_without_ranks(),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    a, b = exported_weights(out), exported_weights(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    p = subprocess.run(  # one rank's store alone is not a model
        [sys.executable, "-m", "fuyou", "export", os.path.join(out, "store", "rank1"), str(tmp_path / "x")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env_without_ranks(),
    )  # fmt: skip
    assert p.returncode == 1 and "holds rank 1's shard of a 2-rank run; pass the run directory" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # ~25 s
def test_a_budget_that_does_not_fit_is_refused_on_every_rank_with_its_reason(tmp_path, model_and_data) -> None:
    """Rank 0 plans for all: its refusal reaches every rank as the same one-line error (none waits)."""
    model, data = model_and_data
    out = str(tmp_path / "run")
    procs = launch_ranks(finetune_args(model, data, out, 1, 1, ("--cpu-memory", "1MiB")), 2)
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 1, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: ") and "--cpu-memory" in last and "another rank" not in last, last


@pytest.mark.slow  # ~40 s
def test_torchrun_lora_writes_what_one_process_writes(tmp_path, model_and_data) -> None:
    """``--lora-rank`` under torchrun with the CLI's defaults (planner, clipping): 2 ranks, each its slice of
    the global batch, write the adapter directory one process writes (rank 0 alone writes it) and the
    merged model."""
    from safetensors.torch import load_file

    model, data = model_and_data
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    lora = ("--lora-rank", "4", "--merge")
    cmd = [sys.executable, "-m", "fuyou"] + finetune_args(model, data, one, 1, 4, lora)
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600, env=env_without_ranks())
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fuyou"]
    p = subprocess.run(
        run + finetune_args(model, data, two, 1, 2, lora), cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=env_without_ranks(),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    a1, a2 = (load_file(os.path.join(d, "adapter", "adapter_model.safetensors")) for d in (one, two))
    assert a1.keys() == a2.keys() and a1
    for k in a1:
        torch.testing.assert_close(a2[k], a1[k], rtol=1e-5, atol=1e-5, msg=k)
    w1, w2 = exported_weights(one), exported_weights(two)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-5, msg=k)
