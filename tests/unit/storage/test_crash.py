"""Crash safety: SIGKILL a committing process at random moments; the store always reopens intact."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from fuyou.storage import TensorStore
from tests.unit.storage.crash_child import EXTENTS, data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("kills", [4, pytest.param(20, marks=pytest.mark.slow)])  # each kill: a process importing torch
def test_sigkill_at_random_moments_never_loses_the_committed_version(tmp_path, kills):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    for d in dirs:
        os.makedirs(d)
    rng = random.Random(1234 + kills)
    last_seen = 0
    for _ in range(kills):
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.unit.storage.crash_child", *dirs], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        first = child.stdout.readline()  # it is committing: kill it somewhere in the next cycles
        assert first.strip(), "child died before its first commit"
        time.sleep(rng.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        printed = [int(first)] + [int(x) for x in child.stdout.read().split()]
        child.wait()
        with TensorStore.open(dirs) as st:
            v = st.version
            assert st.meta == {"v": v}
            # the last version the child reported committed is current (or one newer, if the kill
            # landed after the manifest rename but before the print)
            assert v in (printed[-1], printed[-1] + 1) and v >= last_seen
            for i, e in enumerate(EXTENTS):
                out = torch.empty(e.tensors[0].shape)
                st.read(e.name, out).result()
                assert torch.equal(out, data(v, i)), (v, i)
            last_seen = v
            leftovers = [f for d in dirs for f in os.listdir(d) if ".tmp-" in f]
            assert leftovers == []
