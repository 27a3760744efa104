"""A run directory read back: its per-step metrics and, once the run has finished, its summary.

What ``fuyou report`` reads. A run may be finished (``run.json`` exists: it is written last), still
running (``metrics.jsonl`` is being appended, its last line perhaps half written) or resumed (a step
recorded twice, before and after the resume: the later line wins). Nothing here needs torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from fuyou.errors import ConfigError

METRICS = "metrics.jsonl"
"""The per-step metrics file in a run directory (``fuyou.run.loop``)."""

SUMMARY = "run.json"
"""The run's summary, written when it finishes (``fuyou.run.loop``)."""

FIX = "pass the --output directory of a `fuyou finetune` run"


@dataclass(frozen=True)
class RunRecord:
    """What a run directory holds so far."""

    path: str
    """The run directory (absolute)."""
    metrics_path: str
    """The metrics file read."""
    steps: list[dict[str, Any]]
    """One metrics.jsonl record per step, in step order (``step``: 1-based)."""
    summary: dict[str, Any] | None
    """run.json; None while the run has not finished."""
    torn_line: bool
    """The metrics file ended in an incomplete line (being written), which was left out."""
    replaced: int
    """Records of steps recorded again later (a resumed run redid them), replaced by the later ones."""

    @property
    def finished(self) -> bool:
        """Whether the run has written its summary (run.json)."""
        return self.summary is not None


def read_metrics(path: str) -> tuple[list[dict[str, Any]], bool, int]:
    """The step records of the metrics file ``path``: (records by step, whether an incomplete last line
    was left out, how many records a later one of the same step replaced).

    An unterminated last line that does not parse is a line being written and is left out. Raises
    ConfigError naming the line for any other line that is not a JSON object with a ``step``, and for
    an unreadable file.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror}); {FIX}") from None
    lines = text.split("\n")
    by_step: dict[int, dict[str, Any]] = {}
    torn, replaced = False, 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        unterminated = i == len(lines)  # the text after the last newline
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if unterminated:
                torn = True
                continue
            raise ConfigError(f"{path} line {i} is not JSON; the metrics file is damaged (remove that line)") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise ConfigError(f"{path} line {i} is not a step record (no integer 'step'); {FIX}")
        replaced += rec["step"] in by_step
        by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)], torn, replaced


def load_run(run_dir: str) -> RunRecord:
    """Read the run directory ``run_dir``: its metrics (``RUN_DIR/metrics.jsonl``, else the file run.json
    names) and run.json if the run has finished.

    Raises ConfigError (one line naming the problem and the fix) when ``run_dir`` is missing or not a
    directory, holds neither metrics.jsonl nor run.json, has no step recorded yet, or has a damaged
    run.json or metrics file.
    """
    path = os.path.abspath(run_dir)
    if not os.path.exists(path):
        raise ConfigError(f"{run_dir} does not exist; {FIX}")
    if not os.path.isdir(path):
        raise ConfigError(f"{run_dir} is not a directory; {FIX}")
    summary: dict[str, Any] | None = None
    summary_path = os.path.join(path, SUMMARY)
    if os.path.isfile(summary_path):
        try:
            with open(summary_path) as f:
                summary = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {summary_path} as JSON ({e}); the run's summary is damaged") from None
        if not isinstance(summary, dict):
            raise ConfigError(f"{summary_path} is not a run summary (expected a JSON object); {FIX}")
    metrics = os.path.join(path, METRICS)
    if not os.path.isfile(metrics) and summary is not None and os.path.isfile(str(summary.get("metrics"))):
        metrics = str(summary["metrics"])  # the run wrote its metrics elsewhere (--metrics)
    if not os.path.isfile(metrics):
        if summary is None:
            raise ConfigError(f"{run_dir} is not a fuyou run directory (no {METRICS} or {SUMMARY} in it); {FIX}")
        raise ConfigError(
            f"{run_dir} has a {SUMMARY} but no {METRICS} (nor {summary.get('metrics')}); put the run's metrics file back"
        )
    steps, torn, replaced = read_metrics(metrics)
    if not steps:
        raise ConfigError(f"{run_dir} has no step recorded yet ({metrics} is empty); try again after the first step")
    return RunRecord(path, metrics, steps, summary, torn, replaced)
