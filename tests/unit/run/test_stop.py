"""``fuyou.run.stop``: the first SIGINT/SIGTERM only asks the run to stop; the resume command is the
command line given with ``--resume auto``; ``--save-every`` reads steps or wall time."""

import os
import signal

import pytest

from fuyou.errors import ConfigError
from fuyou.run.config import FinetuneConfig, save_interval
from fuyou.run.stop import StopRequest, resume_command


def test_first_signal_sets_the_request_and_handlers_are_restored():
    said = []
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest(said.append) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread before kill returns
        assert stop.signum == signal.SIGTERM and "SIGTERM received" in said[0]
    assert signal.getsignal(signal.SIGTERM) is before


def test_resume_command_replaces_resume_and_drops_overwrite():
    argv = ["/x/fuyou", "finetune", "m", "--output", "out dir", "--resume", "step-3", "--overwrite", "--steps", "9"]
    assert resume_command(argv) == "fuyou finetune m --output 'out dir' --steps 9 --resume auto"
    assert resume_command(["fuyou", "--debug", "finetune", "--resume=x"]) == "fuyou --debug finetune --resume auto"


def test_save_every_takes_steps_or_wall_time():
    assert save_interval(12) == (12, 0.0) and save_interval("12") == (12, 0.0) and save_interval(0) == (0, 0.0)
    assert save_interval("30min") == (0, 1800.0) and save_interval("2h") == (0, 7200.0)
    assert save_interval("90s") == (0, 90.0) and save_interval("1.5m") == (0, 90.0)
    assert FinetuneConfig().save_every == "30min"  # on by default
    for bad in ("-1", "soon", "0min", "h", True):
        with pytest.raises(ConfigError, match="--save-every must be"):
            save_interval(bad)
    with pytest.raises(ConfigError, match="--keep-best needs --eval-every"):
        FinetuneConfig(keep_best=True)


def test_a_second_sigint_under_torchrun_at_once_is_its_forward_not_a_second_ctrl_c(monkeypatch):
    """torchrun's agent passes the terminal's Ctrl-C on to workers the terminal already signalled."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    said = []
    with StopRequest(said.append) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # would os._exit(130) outside torchrun
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGINT
    assert len(said) == 3 and all("still finishing the step" in s for s in said[1:]), said
