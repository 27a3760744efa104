"""Evaluation along the run: ``--eval-every N`` with ``--eval-data FILE`` records the held-out loss in
metrics.jsonl, TensorBoard and the report's loss panel, without changing what trains; ``--keep-best``
keeps the checkpoint with the lowest held-out loss whatever ``--keep-checkpoints`` prunes, and
``fuyou export --checkpoint best`` writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fuyou.checkpoint import list_checkpoints
from fuyou.cli.main import main
from tests.integration.test_report import scalars
from tests.integration.tiny_models import cli_inputs, exported_weights

STEPS = 8


def finetune(model: str, data: str, out: Path, *extra: str) -> None:
    args = ["finetune", model, "--data", data, "--output", str(out), "--steps", str(STEPS), "--seq-len", "32"]
    args += ["--precision", "fp32", "--lr", "1e-2", "--cpu-memory", "256MiB", "--no-progress", *extra]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output


@pytest.mark.slow  # ~20 s: two runs
def test_eval_every_with_eval_data_and_keep_best(tmp_path: Path) -> None:
    model, data = cli_inputs(tmp_path)
    held = tmp_path / "held.jsonl"  # another distribution: its loss rises once the run fits the training text
    held.write_text("".join(json.dumps({"text": f"class C{i}: pass  # {i * 7} items"}) + "\n" for i in range(20)))
    run, plain = tmp_path / "run", tmp_path / "plain"
    along = ("--eval-every", "2", "--keep-best", "--save-every", "1", "--keep-checkpoints", "1")
    finetune(model, data, run, "--eval-data", str(held), "--report-to", "tensorboard", *along)
    finetune(model, data, plain, "--eval-data", str(held))

    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in recs if "eval_loss" in r}
    assert sorted(evals) == [2, 4, 6]  # the last step's is run.json's eval_loss_after
    s = json.loads((run / "run.json").read_text())
    assert [r["loss"] for r in recs] == [json.loads(x)["loss"] for x in (plain / "metrics.jsonl").open()]
    assert s["eval_loss_before"] == json.loads((plain / "run.json").read_text())["eval_loss_before"]

    best_step = min(evals, key=evals.__getitem__)
    assert s["best_eval_loss"] == evals[best_step] and s["best_checkpoint"].endswith(f"step-{best_step:08d}")
    assert best_step < 6, evals  # so --keep-checkpoints 1 alone would have pruned it
    assert list_checkpoints([str(run / "store")]) == [f"step-{STEPS - 1:08d}", f"step-{best_step:08d}"]

    tb = scalars(run)["eval/loss"]
    assert [x for x, _ in tb] == [0, 2, 4, 6, STEPS]
    want = [s["eval_loss_before"], evals[2], evals[4], evals[6], s["eval_loss_after"]]
    assert [v for _, v in tb] == pytest.approx(want, rel=1e-6)

    out = tmp_path / "page.html"
    r = CliRunner().invoke(main, ["report", str(run), "--output", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert f"lowest {evals[best_step]:.4f} at step {best_step}" in out.read_text()

    r = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "best" / "model"), "--checkpoint", "best"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["export", s["best_checkpoint"], str(tmp_path / "direct" / "model")])
    assert r.exit_code == 0, r.output
    best, direct, last = (exported_weights(str(tmp_path / n)) for n in ("best", "direct", "run"))
    assert best.keys() == last.keys() and all((best[k] == direct[k]).all() for k in best)
    assert any(not (best[k] == last[k]).all() for k in best)  # the best step's weights, not the last

    r = CliRunner().invoke(main, ["export", str(plain), str(tmp_path / "x"), "--checkpoint", "best"])
    assert r.exit_code == 1 and "--checkpoint best needs a run directory" in r.output, r.output
