"""Launched as several processes, ``fuyou finetune`` and the engine join the ranks (torchrun's
environment) and refuse an incomplete one before touching anything (FuyouTrainer's arguments are
transformers', which refuse it themselves)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fuyou.cli.main import main
from fuyou.errors import ConfigError
from tests.integration.tiny_models import tiny


def test_cli_refuses_an_incomplete_multi_process_launch_and_touches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["finetune", "no-such-model", "--output", str(out), "--steps", "1"])
    assert r.exit_code != 0
    assert "RANK, MASTER_ADDR, MASTER_PORT is not set; launch the ranks with torchrun" in r.output
    assert not out.exists()


def test_engine_needs_a_complete_launch(tmp_path, monkeypatch):
    from fuyou.engine import Engine, EngineConfig

    cfg, model = tiny("llama", layers=1)
    monkeypatch.setenv("WORLD_SIZE", "3")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="RANK, MASTER_ADDR, MASTER_PORT is not set; launch the ranks with torchrun"):
        Engine.from_state_dict(cfg, model.state_dict(), EngineConfig(ssd_dirs=(str(tmp_path / "s"),)))
    assert not (tmp_path / "s").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")  # a one-process launch is fine: no refusal
    (tmp_path / "s").mkdir()
    Engine.from_state_dict(cfg, model.state_dict(), EngineConfig(ssd_dirs=(str(tmp_path / "s"),))).close()
