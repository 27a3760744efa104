"""SIGKILL a real `fuyou finetune` at random moments; resuming each time ends bit-identical to a clean run.

Runs once per I/O backend (``$FUYOU_IO``: posix, the non-descriptor pyfile engine, kvikio where usable);
the clean run is shared (made with the default engine), so every engine must also match it bit for bit.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from fuyou.checkpoint import list_checkpoints, validate
from tests.integration.tiny_models import cli_inputs, exported_weights
from tests.io_engines import engines_posix_first, use_engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 24


def command(model, data, out):
    return [
        sys.executable,
        "-m",
        "fuyou.cli.main",
        "finetune",
        model,
        "--data",
        data,
        "--output",
        out,
        "--steps",
        str(STEPS),
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--grad-accum",
        "2",
        "--precision",
        "fp32",
        "--lr",
        "1e-3",
        "--max-grad-norm",
        "1.0",
        "--cpu-memory",
        "256MiB",
        "--save-every",
        "1",
        "--keep-checkpoints",
        "2",
        "--resume",
        "auto",
        "--no-progress",
    ]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """(model dir, data file, output of an uninterrupted run with the default engine), made once."""
    tmp = tmp_path_factory.mktemp("clean")
    model, data = cli_inputs(tmp)
    clean = str(tmp / "clean")
    env = {k: v for k, v in os.environ.items() if k != "FUYOU_IO"}
    subprocess.run(command(model, str(data), clean), cwd=ROOT, check=True, capture_output=True, timeout=600, env=env)
    return model, str(data), clean


@pytest.mark.slow  # ~55-75 s each (the default tier's store-level SIGKILL test: tests/unit/storage/test_crash.py)
@pytest.mark.parametrize("io", engines_posix_first())
def test_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path, monkeypatch, clean_run, io):
    use_engine(monkeypatch, io)  # the killed runs (children) and the checks here use this engine
    model, data, clean = clean_run
    out = str(tmp_path / "killed")
    rng = random.Random(7)
    kills = 0
    for _ in range(10):
        child = subprocess.Popen(command(model, data, out), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(1.0, 7.0))
        if child.poll() is not None:
            assert child.returncode == 0, child.stderr.read().decode()[-2000:]
            break
        child.send_signal(signal.SIGKILL)
        child.wait()
        kills += 1
        stripes = [os.path.join(out, "store")]
        for name in list_checkpoints(stripes):  # no run ever leaves an unreadable checkpoint behind
            validate(stripes, name)
    if not os.path.exists(os.path.join(out, "run.json")):
        r = subprocess.run(command(model, data, out), cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    assert kills == 10, f"the run finished after {kills} kills: lengthen it"
    a, b = exported_weights(clean), exported_weights(out)
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), [k for k in a if not (a[k] == b[k]).all()][:3]
    la = [json.loads(x)["loss"] for x in open(os.path.join(clean, "metrics.jsonl"))]
    lb = [json.loads(x)["loss"] for x in open(os.path.join(out, "metrics.jsonl"))]
    assert la == lb and len(la) == STEPS
