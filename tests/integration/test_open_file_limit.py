"""Open files stay bounded whatever the model size: a model with over a thousand extents (2× as many
store files) imports and trains under ``ulimit -n 256``, and matches plain PyTorch + AdamW."""

import json
import os
import resource
import subprocess
import sys

import pytest

from tests.integration.tiny_models import batches, reference_steps, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOFILE = 256
LAYERS, HIDDEN, STATE_CHUNK, STEPS = 100, 16, 256, 2
"""~2.3k parameters per layer in 256-element state chunks: 10 state extents + 1 weight extent per
block, ~1.1k extents and ~2.2k store files in all."""
LR, WD = 1e-3, 0.01


def limit_open_files() -> None:
    """In the child, before exec: soft and hard RLIMIT_NOFILE = NOFILE (what ``ulimit -n 256`` does)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.mark.slow  # 21 s on 2 cores: a system limit, not a step's arithmetic
def test_thousands_of_store_files_train_under_ulimit_256(tmp_path):
    cfg, model = tiny("llama", layers=LAYERS, hidden=HIDDEN)
    model_dir, ssd = tmp_path / "model", tmp_path / "ssd"
    model.save_pretrained(str(model_dir))
    ssd.mkdir()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integration.nofile_child",
            str(model_dir),
            str(ssd),
            str(STEPS),
            str(STATE_CHUNK),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        preexec_fn=limit_open_files,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["nofile"] == NOFILE
    assert out["extents"] > 1000 and out["store_files"] > 4 * NOFILE, out
    assert out["peak_fds"] < NOFILE, out
    ref = reference_steps(model, batches(STEPS), 1, LR, WD)
    assert out["losses"] == pytest.approx(ref, rel=1e-5)
    sq = {k: float(v.detach().double().square().sum()) for k, v in model.state_dict().items()}
    for k, v in out["weights_sq"].items():
        assert v == pytest.approx(sq[k], rel=1e-5), k
