"""``--report-to wandb``: a real offline W&B run (``WANDB_MODE=offline``, no network) holds every
step's metrics and the held-out losses, read back from the run's own ``.wandb`` file; without the
package the run refuses in one line before any work."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fuyou.cli.main import main
from tests.integration.tiny_models import cli_inputs

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def wandb_records(path: str) -> list:
    """The protobuf records of a ``.wandb`` transaction log (LevelDB's log format behind a 7-byte
    ``:W&B`` header, 32 KiB blocks; wandb ≥ 0.19 ships no Python reader of its own)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    i, out, buf = 7, [], b""
    while i + 7 <= len(data):
        left = 32768 - i % 32768
        _crc, n, kind = struct.unpack("<IHB", data[i : i + 7]) if left >= 7 else (0, 0, 0)
        if n == 0 and kind == 0:  # block padding
            i += left
            continue
        buf += data[i + 7 : i + 7 + n]
        i += 7 + n
        if kind in (1, 4):  # a whole record, or its last piece
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def history(run_dir: str) -> list[dict]:
    (log,) = glob.glob(os.path.join(run_dir, "*.wandb"))
    rows = [r.history for r in wandb_records(log) if r.WhichOneof("record_type") == "history"]
    return [{("/".join(i.nested_key) or i.key): json.loads(i.value_json) for i in h.item} for h in rows]


@pytest.mark.slow  # ~12 s
def test_report_to_wandb_offline_logs_every_step_and_the_held_out_loss(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    model, data = cli_inputs(tmp_path)
    out = tmp_path / "run"
    args = ["finetune", model, "--data", data, "--output", str(out), "--steps", str(STEPS), "--seq-len", "32"]
    args += ["--cpu-memory", "256MiB", "--eval-fraction", "0.1", "--eval-every", "2", "--no-progress"]
    r = CliRunner().invoke(main, [*args, "--report-to", "wandb"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    s = json.loads((out / "run.json").read_text())
    assert s["wandb"].startswith(str(tmp_path / "wb")) and s["tensorboard"] is None
    rows = history(s["wandb"])
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "train/loss" in row]
    assert [row["train/step"] for row in train] == [1, 2, 3, 4]
    assert [row["train/loss"] for row in train] == pytest.approx([x["loss"] for x in recs], rel=1e-7)
    assert all(row["busy/" + k] == pytest.approx(v) for row, x in zip(train, recs) for k, v in x["busy_frac"].items())
    held = [(row["train/step"], row["eval/loss"]) for row in rows if "eval/loss" in row]
    want = [(0, s["eval_loss_before"]), (2, recs[1]["eval_loss"]), (STEPS, s["eval_loss_after"])]
    assert held == pytest.approx(want, rel=1e-7)
    assert (out / "wandb-run-id").read_text() in s["wandb"]  # a resume continues this W&B run


def test_without_wandb_the_run_refuses_in_one_line_before_any_work(tmp_path):
    model, data = cli_inputs(tmp_path)
    out = tmp_path / "run"
    hide = "import sys; sys.modules['wandb'] = None; from fuyou.cli.main import main; main()"  # import fails
    p = subprocess.run(
        [sys.executable, "-c", hide, "finetune", model, "--data", data, "--output", str(out), "--report-to",
         "tensorboard,wandb", "--steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 1
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("error: --report-to wandb needs the wandb package") and '".[wandb]"' in line, line
    assert not out.exists()  # nothing was made


def test_report_to_names_the_choices(tmp_path):
    r = CliRunner().invoke(
        main, ["finetune", "m", "--output", str(tmp_path / "o"), "--report-to", "tensorboard,mlflow"]
    )
    assert r.exit_code == 1
    assert "--report-to must be one or more of none, tensorboard, wandb, got 'tensorboard,mlflow'" in r.output
