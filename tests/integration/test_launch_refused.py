"""Launched as several processes (torchrun), ``fuyou finetune`` and FuyouTrainer refuse before touching
anything (they would each run a whole, independent copy over the same directories); the engine joins
the ranks, and refuses an incomplete launch environment before touching anything."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from fuyou.cli.main import main
from fuyou.errors import ConfigError
from tests.integration.tiny_models import tiny


def test_cli_refuses_under_a_multi_process_launch_and_touches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["finetune", "no-such-model", "--output", str(out), "--steps", "1"])
    assert r.exit_code != 0
    assert "launched as one of 2 processes" in r.output and "without torchrun" in r.output
    assert not out.exists()


def test_engine_needs_a_complete_launch_and_the_trainer_refuses(tmp_path, monkeypatch):
    from fuyou import FuyouTrainer, FuyouTrainingArguments
    from fuyou.engine import Engine, EngineConfig

    cfg, model = tiny("llama", layers=1)
    monkeypatch.setenv("WORLD_SIZE", "3")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="RANK, MASTER_ADDR, MASTER_PORT is not set; launch the ranks with torchrun"):
        Engine.from_state_dict(cfg, model.state_dict(), EngineConfig(ssd_dirs=(str(tmp_path / "s"),)))
    assert not (tmp_path / "s").exists()
    args = FuyouTrainingArguments(output_dir=str(tmp_path / "o"), ssd_dirs=[str(tmp_path / "s")], report_to=[])
    with pytest.raises(ConfigError, match="FuyouTrainer was launched as one of 3 processes"):
        FuyouTrainer(model=model, args=args)
    monkeypatch.setenv("WORLD_SIZE", "1")  # a one-process launch is fine: no refusal
    (tmp_path / "s").mkdir()
    Engine.from_state_dict(cfg, model.state_dict(), EngineConfig(ssd_dirs=(str(tmp_path / "s"),))).close()


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_torchrun_with_two_processes_exits_non_zero_with_the_reason(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "fuyou",
            "finetune",
            "no-such-model",
            "--output",
            str(out),
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode != 0
    assert "launched as one of 2 processes" in p.stdout + p.stderr
    assert not out.exists()
