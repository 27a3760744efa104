"""A run's ranks tear down the process group ``join`` set up once the run is over, and leave one a caller
(a Trainer, a script) set up alone. Each case runs in its own process: a process group is process-wide."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.integration.test_data_parallel import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CHILD = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from fuyou.run.ranks import join

    if sys.argv[1] == "caller":  # the caller set up the default group before the run joined it
        dist.init_process_group("gloo")
    ranks = join("cpu")
    assert dist.is_initialized() and ranks.world == 1
    ranks.close()
    print("owned" if ranks.owned else "caller's", "initialized" if dist.is_initialized() else "destroyed")
    """
)


@pytest.mark.parametrize("setup, expected", [("join", "owned destroyed"), ("caller", "caller's initialized")])
def test_close_destroys_only_the_group_join_set_up(setup: str, expected: str) -> None:
    env = os.environ | {
        "FUYOU_COLLECTIVES": "1",  # one rank through the collectives, as torchrun --nproc-per-node 1
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    r = subprocess.run(
        [sys.executable, "-c", CHILD, setup], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected
