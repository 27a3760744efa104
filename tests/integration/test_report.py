"""Seeing a run: ``fuyou finetune --report-to tensorboard`` and ``fuyou report RUN_DIR``, on a real tiny CPU run.

The event file is read back with TensorBoard's own reader; the HTML page is checked against the run's
metrics.jsonl and run.json, its figures decoded. Then: a running directory (no run.json) whose metrics
end in a torn line and repeat a step, bad run directories, a missing extra, and a resumed run.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fuyou.cli.main import main
from fuyou.units import format_size
from tests.integration.tiny_models import cli_inputs

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
PANELS = {
    "overview": "Run",
    "loss": "Loss: train and held-out",
    "speed": "Speed: tokens/s and TFLOPS per step",
    "busy": "Where the step time goes: busy fraction per resource",
    "ssd": "SSD traffic per step and drive endurance",
    "plan": "Plan: predicted against measured step time",
    "memory": "Host memory: peak against the budget",
    "steps": "Every step's numbers",
}


def finetune(model: str, data: str, out: Path, *extra: str) -> Any:
    """A real ``fuyou finetune`` of the tiny model: 4 steps, a 64 MiB host budget (the store streams from
    the SSD, so SSD bytes are not zero), held-out data, a checkpoint after step 2, TensorBoard on."""
    args = ["finetune", model, "--data", data, "--output", str(out), "--steps", str(STEPS), "--seq-len", "32"]
    args += ["--cpu-memory", "64MiB", "--eval-fraction", "0.1", "--save-every", "2", "--report-to", "tensorboard"]
    r = CliRunner().invoke(main, args + list(extra), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return cli_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, inputs: tuple[str, str]) -> Path:
    out = tmp_path_factory.mktemp("report") / "run"
    r = finetune(*inputs, out)  # with the progress bar and end-of-run table
    table = re.sub(r"[\s│]", "", r.output)  # the end-of-run table, its cells' wrapping undone
    assert f"fuyoureport{out}" in table and f"tensorboard--logdir{out}/tensorboard" in table
    return out


def metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the run's event files, read by TensorBoard itself: tag → [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def check_tensorboard_matches(run: Path) -> None:
    recs, summary, got = metrics(run), json.loads((run / "run.json").read_text()), scalars(run)
    steps = [r["step"] for r in recs]
    assert steps == list(range(1, STEPS + 1))
    for key, tag in [
        ("loss", "train/loss"),
        ("lr", "train/lr"),
        ("grad_norm", "train/grad_norm"),
        ("tokens_per_s", "speed/tokens_per_s"),
        ("tflops", "speed/tflops"),
        ("step_time_s", "speed/step_time_s"),
        ("ssd_read_gb", "ssd/read_gb"),
        ("ssd_write_gb", "ssd/write_gb"),
    ]:
        assert [s for s, _ in got[tag]] == steps, tag  # each step once
        assert [v for _, v in got[tag]] == pytest.approx([r[key] for r in recs], rel=1e-6, abs=1e-12), tag
    for resource in recs[0]["busy_frac"]:
        want = [r["busy_frac"][resource] for r in recs]
        assert [v for _, v in got[f"busy/{resource}"]] == pytest.approx(want, rel=1e-6, abs=1e-12), resource
    assert sum(r["ssd_write_gb"] for r in recs) > 0 and sum(r["ssd_read_gb"] for r in recs) > 0
    held = [(0, summary["eval_loss_before"]), (STEPS, summary["eval_loss_after"])]
    assert [s for s, _ in got["eval/loss"]] == [s for s, _ in held]
    assert [v for _, v in got["eval/loss"]] == pytest.approx([v for _, v in held], rel=1e-6)


def test_tensorboard_holds_the_metrics_of_every_step(run_dir: Path) -> None:
    check_tensorboard_matches(run_dir)


def images(page: str) -> list[tuple[str, bytes]]:
    """(alt text, PNG bytes) of every figure in the page."""
    found = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', page)
    return [(alt, base64.b64decode(data)) for alt, data in found]


def test_report_draws_every_panel_from_the_run(run_dir: Path, tmp_path: Path) -> None:
    import numpy as np
    from matplotlib.image import imread

    out = tmp_path / "page.html"
    r = CliRunner().invoke(main, ["report", str(run_dir), "--output", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert str(out) in r.output
    page = out.read_text()
    recs, s = metrics(run_dir), json.loads((run_dir / "run.json").read_text())
    for ident, title in PANELS.items():
        assert f'<section id="{ident}">\n<h2>{html.escape(title)}</h2>' in page, ident
    assert not re.search(r"(src|href)=\"(?!data:)|<script|<link|url\(", page)  # nothing loaded from elsewhere
    # every step's row, from metrics.jsonl
    busy = [res for res in recs[0]["busy_frac"] if statistics.fmean(r["busy_frac"][res] for r in recs) > 0]
    for rec in recs:
        cells = [str(rec["step"]), f"{rec['loss']:.4f}", f"{rec['lr']:.3g}", f"{rec['grad_norm']:.3f}"]
        cells += [f"{rec['tokens_per_s']:.1f}", f"{rec['tflops']:.4f}", f"{rec['step_time_s']:.3f}"]
        cells += [f"{rec['ssd_read_gb']:.3f}", f"{rec['ssd_write_gb']:.3f}"]
        cells += [f"{rec['busy_frac'][res]:.2f}" for res in busy] + [rec["bottleneck"]]
        assert "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>" in page, rec["step"]
    # the panels' figures
    before, after = s["eval_loss_before"], s["eval_loss_after"]
    assert f"{before:.4f} (step 0) → {after:.4f} (step {STEPS})" in page
    assert f"{recs[0]['loss']:.4f} (step 1) → {recs[-1]['loss']:.4f} (step {STEPS})" in page

    def steady(key: str) -> float:
        return statistics.median(r[key] for r in recs[1:])  # the steps after the first

    assert f"<td>{steady('tokens_per_s'):.1f}</td>" in page and f"<td>{steady('tflops'):.4f}</td>" in page
    top = statistics.mode(r["bottleneck"] for r in recs)
    assert f"Bottleneck: {top} (the busiest resource in" in page
    written, seconds = sum(r["ssd_write_gb"] for r in recs) * 1e9, sum(r["step_time_s"] for r in recs)
    assert f"{format_size(written / seconds * 86400)}/day = " in page and " drive-writes/day of this " in page
    plan = s["plan"]
    assert plan["source"] == "planner"
    assert f"{plan['predicted_step_s']:.3f} s, bottleneck {plan['predicted_bottleneck']}" in page
    assert f"<td>{steady('step_time_s'):.3f} s</td>" in page
    assert f"prefetch depth {plan['executed']['prefetch_depth']}" in page
    assert format_size(s["peak_rss_bytes"]) in page and format_size(s["cpu_memory_bytes"]) in page
    assert f"tensorboard --logdir {run_dir / 'tensorboard'}" in page
    # the figures: real PNGs, drawn (not blank), one per panel but the overview and the table
    figures = images(page)
    assert len(figures) == 6
    assert f"train {recs[0]['loss']:.4f} → {recs[-1]['loss']:.4f}" in figures[0][0]
    for alt, png in figures:
        assert png[:8] == b"\x89PNG\r\n\x1a\n", alt
        pixels = imread(io.BytesIO(png))
        assert pixels.shape[1] == 1000 and pixels.shape[0] >= 150, alt
        assert len(np.unique(pixels.reshape(-1, pixels.shape[2]), axis=0)) > 20, alt  # more than a blank frame
    loss_png = imread(io.BytesIO(figures[0][1]))[..., :3]
    blue = np.all(np.abs(loss_png - np.array([0x4C, 0x72, 0xB0]) / 255) < 0.02, axis=-1)
    assert blue.sum() > 200  # the train-loss curve is drawn


def test_report_of_a_running_resumed_directory(run_dir: Path, tmp_path: Path) -> None:
    """No run.json yet; step 3 recorded twice (the later record counts) and a half-written last line."""
    running = tmp_path / "running"
    running.mkdir()
    recs = metrics(run_dir)[:3]
    again = {**recs[2], "loss": 1.2345678, "tokens_per_s": 4321.5}
    lines = [json.dumps(r) for r in recs] + [json.dumps(again)]
    (running / "metrics.jsonl").write_text("\n".join(lines) + "\n" + json.dumps(recs[0])[:40])
    r = CliRunner().invoke(main, ["report", str(running)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    page = (running / "report.html").read_text()
    assert "<td>3</td><td>1.2346</td>" in page and "<td>4321.5</td>" in page
    assert f"<td>3</td><td>{recs[2]['loss']:.4f}</td>" not in page
    assert page.count("<tr><td>3</td>") == 1 and "<tr><td>4</td>" not in page
    assert "1 step record(s) repeated after a resume" in page and "last line is incomplete" in page
    assert "not finished (no run.json yet)" in page and "recorded in run.json when the run finishes" in page
    assert len(images(page)) == 5  # the memory panel waits for run.json
    assert f"{recs[0]['loss']:.4f} (step 1) → 1.2346 (step 3)" in page


def cli_error(args: list[str], *prelude: str) -> str:
    """Run the real console script (after ``prelude`` statements): one line on stderr, exit 1."""
    code = "; ".join([*prelude, "from fuyou.cli.main import main", "main()"])
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr.strip()


def test_not_a_run_directory_is_one_line_error(run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "no-steps").mkdir()
    (tmp_path / "no-steps" / "metrics.jsonl").write_text("")
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2,\n{"step": 3}\n')
    cases = [
        ("missing", "does not exist; pass the --output directory of a `fuyou finetune` run"),
        ("a-file", "is not a directory"),
        ("empty", "is not a fuyou run directory (no metrics.jsonl or run.json in it); pass the --output"),
        ("no-steps", "has no step recorded yet"),
        ("damaged", "line 2 is not JSON"),
    ]
    for name, message in cases:
        r = CliRunner().invoke(main, ["report", str(tmp_path / name)])
        assert r.exit_code == 1 and message in r.output, (name, r.output)
        assert r.output.startswith("error: ") and len(r.output.strip().splitlines()) == 1, r.output
    assert "does not exist" in cli_error(["report", str(tmp_path / "missing")])
    assert not (tmp_path / "empty" / "report.html").exists()


def test_missing_extra_is_one_line_error_before_training(
    run_dir: Path, inputs: tuple[str, str], tmp_path: Path
) -> None:
    """Without the packages (their import fails, as when not installed), the commands stop at once."""
    gone = "import sys; sys.modules['tensorboard'] = None"
    out = tmp_path / "run"
    msg = cli_error(
        ["finetune", *inputs[:1], "--data", inputs[1], "--output", str(out), "--report-to", "tensorboard"], gone
    )
    assert "needs the tensorboard package" in msg and 'pip install -e ".[report]"' in msg, msg
    assert not (out / "metrics.jsonl").exists() and not (out / "store").exists()
    msg = cli_error(["report", str(run_dir)], "import sys; sys.modules['matplotlib'] = None")
    assert "fuyou report needs matplotlib" in msg and 'pip install -e ".[report]"' in msg, msg


def test_resumed_run_appends_to_tensorboard(run_dir: Path, inputs: tuple[str, str], tmp_path: Path) -> None:
    """``--resume auto`` redoes steps 3 and 4: TensorBoard shows each step once, with the redone values."""
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed, symlinks=True)
    files = {p.name for p in (resumed / "tensorboard").iterdir()}
    finetune(*inputs, resumed, "--resume", "auto", "--no-progress")
    assert len(set(os.listdir(resumed / "tensorboard")) - files) == 1  # appended: a second event file
    assert json.loads((resumed / "run.json").read_text())["resumed_from_step"] == 2
    check_tensorboard_matches(resumed)
