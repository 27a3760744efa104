"""Concurrent numba kernel launches (gradient norm on the training thread, Adam on its worker) are
safe under every threading layer numba may pick, including its fallback ``workqueue`` layer."""

import json
import os
import subprocess
import sys

import pytest

from fuyou.optim import parallel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # ~12 s; the serialisation rule below stays in the default tier
def test_training_under_the_workqueue_threading_layer_finishes_correctly(tmp_path):
    """Both schedules, a few steps each, in a child forced onto ``workqueue`` (which aborts the process
    on concurrent launches): it must finish and match plain PyTorch + AdamW."""
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    r = subprocess.run(
        [sys.executable, "-m", "tests.integration.numba_layer_child", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["layer"] == "workqueue"
    assert set(out) >= {"clip=0.0", "clip=1.0"}


@pytest.mark.parametrize("layer,locked", [(None, True), ("workqueue", True), ("omp", False), ("tbb", False)])
def test_launches_are_serialised_only_where_the_layer_needs_it(monkeypatch, layer, locked):
    monkeypatch.setattr(parallel, "_layer", layer)
    if layer is None:  # numba has not chosen a layer yet: lock until it has

        def not_chosen():
            raise ValueError("Threading layer is not initialized.")

        monkeypatch.setattr(parallel.numba, "threading_layer", not_chosen)
    assert parallel.needs_lock() is locked
    with parallel.parallel_launch():
        assert parallel.KERNEL_LOCK.locked() is locked
    assert not parallel.KERNEL_LOCK.locked()
