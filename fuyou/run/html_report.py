"""``fuyou report RUN_DIR``: one self-contained HTML page showing a run (read by ``fuyou.run.run_record``).

Panels: the loss (train per step, held-out before and after training), speed (tokens/s and TFLOPS per
step), where the step time goes (busy fraction per resource, stacked, and the bottleneck), SSD bytes
per step and what they mean for drive endurance, the plan with its predicted against the measured step
time, peak host memory against the host budget, and every step's numbers. A run that has not finished
has no run.json yet: its plan, held-out loss and memory panels say so. Figures are drawn with
matplotlib (Agg, no display) and embedded as base64 PNG; the page loads nothing else. Needs the
``report`` extra (matplotlib).
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import statistics
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from fuyou.errors import ConfigError
from fuyou.run.report import ssd_endurance
from fuyou.run.run_record import SUMMARY, RunRecord, load_run
from fuyou.run.tensorboard import INSTALL
from fuyou.units import format_size

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

REPORT = "report.html"
"""The page's file name in the run directory (the default output)."""

WIDTH_IN, DPI = 10.0, 100
"""Figure width in inches and resolution: 1000-pixel-wide PNGs."""

MARKERS_UP_TO = 60
"""Steps up to which curves mark each step's point."""

TABLE_ROWS = 2000
"""Rows of the per-step table at most: a longer run shows every k-th step and the last."""

COLOURS = {
    "compute": "#4c72b0",
    "adam": "#dd8452",
    "h2d": "#55a868",
    "d2h": "#8172b3",
    "ssd_read": "#c44e52",
    "ssd_write": "#937860",
    "comm": "#da8bc3",
    "ram_copy": "#8c8c8c",
}
"""Colour of each resource (``fuyou.timeline.RESOURCES``) in the busy-fraction panel."""

NOT_YET = f"recorded in {SUMMARY} when the run finishes (this run has not finished)"


def write_report(run_dir: str, output: str | None = None) -> str:
    """Write the HTML report of the run in ``run_dir`` to ``output`` (default ``RUN_DIR/report.html``);
    return its path.

    Raises ConfigError (one line) when ``run_dir`` is not a run directory or has no step yet
    (``load_run``), when matplotlib is missing, or when ``output`` cannot be written.
    """
    run = load_run(run_dir)
    page = render(run)
    path = os.path.abspath(output or os.path.join(run.path, REPORT))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, path)  # a browser open on the old page never sees half of the new one
    except OSError as e:
        raise ConfigError(f"cannot write the report to {path} ({e.strerror}); pass a writable --output") from None
    return path


def render(run: RunRecord) -> str:
    """The report page of ``run`` as one HTML document. Raises ConfigError when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401 - the import is the check; figures draw on their own Agg canvas
    except ImportError as e:
        raise ConfigError(f"fuyou report needs matplotlib ({e}); install it with {INSTALL}") from None
    body = "\n".join(
        [_overview(run), _loss(run), _speed(run), _busy(run), _ssd(run), _plan(run), _memory(run), _table(run)]
    )
    title = f"Fuyou run {os.path.basename(run.path)}"
    return PAGE.format(title=html.escape(title), body=body)


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; max-width: 1040px; margin: 1.5em auto;
  padding: 0 1em; color: #222; line-height: 1.4; }}
h1 {{ font-size: 1.6em; margin-bottom: 0.2em; }}
h2 {{ font-size: 1.25em; border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 1.6em; }}
section img {{ width: 100%; height: auto; display: block; margin: 0.5em 0; }}
table {{ border-collapse: collapse; font-size: 0.85em; }}
td, th {{ border: 1px solid #ddd; padding: 2px 8px; text-align: right; }}
td {{ white-space: nowrap; }}
.scroll {{ overflow-x: auto; }}
table.steps {{ font-size: 0.8em; }}
th {{ background: #f3f3f3; text-align: center; }}
table.facts td:first-child {{ text-align: left; color: #555; }}
table.facts td {{ text-align: left; white-space: normal; }}
table.facts td:first-child {{ white-space: nowrap; }}
.note {{ color: #666; font-size: 0.9em; }}
.bottleneck {{ font-weight: bold; }}
</style></head>
<body>
<h1>{title}</h1>
{body}
</body></html>
"""


def _section(ident: str, title: str, *parts: str) -> str:
    return f'<section id="{ident}">\n<h2>{html.escape(title)}</h2>\n' + "\n".join(parts) + "\n</section>"


def _facts(rows: list[tuple[str, str]]) -> str:
    """A two-column table of (label, value) rows, both escaped."""
    cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="facts">{cells}</table>'


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def _figure(height_in: float, rows: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure ``height_in`` inches high with ``rows`` stacked axes sharing the step axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without pyplot: no display, and no backend switched for the rest of the process
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0].tolist()
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("step")
    return fig, axes


def _png(fig: Figure, alt: str) -> str:
    """``fig`` as an ``<img>`` holding a base64 PNG, described by ``alt``."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _marker(run: RunRecord) -> str:
    return "o" if len(run.steps) <= MARKERS_UP_TO else ""


def _steps(run: RunRecord) -> list[int]:
    return [r["step"] for r in run.steps]


def _col(run: RunRecord, key: str) -> list[float]:
    """One metric of every step (NaN where a record lacks it)."""
    return [float(r[key]) if r.get(key) is not None else float("nan") for r in run.steps]


def _steady(values: list[float]) -> list[float]:
    """The steps after the first (which warms up: first reads, allocations), or the one step there is."""
    return values[1:] or values


def _overview(run: RunRecord) -> str:
    s = run.summary or {}
    last = run.steps[-1]["step"]
    rows = [("run directory", run.path)]
    if run.finished:
        rows.append(("status", f"finished: {s.get('steps', last)} steps ({SUMMARY} written)"))
    else:
        rows.append(("status", f"not finished (no {SUMMARY} yet): running, or stopped; {last} steps recorded"))
    if s.get("model"):
        rows.append(("model", str(s["model"])))
    if isinstance(s.get("precision"), dict):
        rows.append(("precision", str(s["precision"].get("precision"))))
    rows.append(("tokens recorded", f"{sum(int(r.get('tokens', 0)) for r in run.steps):,}"))
    if s.get("resumed_from_step"):
        rows.append(("resumed", f"from the checkpoint after step {s['resumed_from_step']}"))
    if s.get("ranks", 1) > 1:
        rows.append(("ranks", f"{s['ranks']} (speed: all ranks; busy fractions and SSD bytes: rank 0)"))
    if s.get("tensorboard"):
        rows.append(("TensorBoard", f"tensorboard --logdir {s['tensorboard']}"))
    rows.append(("metrics", run.metrics_path))
    rows.append(("report made", time.strftime("%Y-%m-%d %H:%M:%S")))
    notes = []
    if run.replaced:
        notes.append(f"{run.replaced} step record(s) repeated after a resume: the later record of each step is shown.")
    if run.torn_line:
        notes.append("The metrics file's last line is incomplete (being written) and is left out.")
    return _section("overview", "Run", _facts(rows), *(_note(n) for n in notes))


def _held_out(run: RunRecord) -> list[tuple[int, float]]:
    """The held-out losses as (step, loss): before training (step 0), at each ``--eval-every``
    evaluation (the steps' ``eval_loss``) and after it (the last step)."""
    s = run.summary or {}
    along = [(int(r["step"]), r.get("eval_loss")) for r in run.steps]
    last = int(s.get("steps", run.steps[-1]["step"]))
    points = [(0, s.get("eval_loss_before")), *along, (last, s.get("eval_loss_after"))]
    return [(x, float(y)) for x, y in points if y is not None]


def _loss(run: RunRecord) -> str:
    steps, loss = _steps(run), _col(run, "loss")
    held = _held_out(run)
    fig, (ax,) = _figure(3.6)
    ax.plot(steps, loss, marker=_marker(run), color="#4c72b0", label="train loss (each step's batch)")
    if held:
        xs, ys = zip(*held)
        ax.plot(xs, ys, "s--", color="#c44e52", label="held-out loss (before, every --eval-every steps, after)")
        ends = [held[0], held[-1]] if len(held) > 1 else held  # labelled: the first and the last
        for i, (x, y) in enumerate(ends):  # the first label right of its point, the last one left: inside the axes
            last = i == len(ends) - 1 and len(ends) > 1
            ax.annotate(
                f"{y:.4f}",
                (x, y),
                textcoords="offset points",
                xytext=(-8 if last else 8, 8),
                ha="right" if last else "left",
                color="#c44e52",
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},  # over the curve
            )
    ax.margins(x=0.03, y=0.15)  # room for the held-out values' labels
    ax.set_ylabel("loss")
    ax.legend(loc="best")
    rows = [("train loss", f"{loss[0]:.4f} (step {steps[0]}) → {loss[-1]:.4f} (step {steps[-1]})")]
    if held:
        shown = held if len(held) <= 6 else [*held[:2], *held[-3:]]  # the table stays one line
        best = min(held, key=lambda p: p[1])
        text = " → ".join(f"{y:.4f} (step {x})" for x, y in shown) + (" …" if len(shown) < len(held) else "")
        rows.append(("held-out loss", text + (f"; lowest {best[1]:.4f} at step {best[0]}" if len(held) > 2 else "")))
    elif run.finished:
        rows.append(("held-out loss", "none: the run held out no data (--eval-fraction 0)"))
    else:
        rows.append(("held-out loss", f"measured before and after training; {NOT_YET}"))
    alt = f"loss per step, steps {steps[0]}–{steps[-1]}: train {loss[0]:.4f} → {loss[-1]:.4f}"
    return _section("loss", "Loss: train and held-out", _png(fig, alt), _facts(rows))


def _speed(run: RunRecord) -> str:
    steps, tps, tflops = _steps(run), _col(run, "tokens_per_s"), _col(run, "tflops")
    fig, (top, bottom) = _figure(4.6, rows=2)
    top.plot(steps, tps, marker=_marker(run), color="#55a868")
    top.set_ylabel("tokens/s")
    bottom.plot(steps, tflops, marker=_marker(run), color="#8172b3")
    bottom.set_ylabel("TFLOPS")
    formula = run.steps[-1].get("flop_formula", "")
    rows = [
        ("tokens/s (median of steady steps)", f"{statistics.median(_steady(tps)):.1f}"),
        ("TFLOPS (median of steady steps)", f"{statistics.median(_steady(tflops)):.4f}"),
    ]
    alt = f"tokens/s and TFLOPS per step, steps {steps[0]}–{steps[-1]}"
    parts = [_png(fig, alt), _facts(rows)]
    if formula:
        parts.append(_note(f"TFLOPS count model FLOPs: {formula}."))
    return _section("speed", "Speed: tokens/s and TFLOPS per step", *parts)


def _mean_busy(run: RunRecord) -> dict[str, float]:
    """Each resource's busy fraction averaged over the recorded steps (0 to 1)."""
    names: list[str] = []
    for r in run.steps:
        names += [k for k in r.get("busy_frac", {}) if k not in names]
    return {res: statistics.fmean(float(r.get("busy_frac", {}).get(res, 0.0)) for r in run.steps) for res in names}


def _busy(run: RunRecord) -> str:
    steps = _steps(run)
    mean = _mean_busy(run)
    resources = [res for res in sorted(mean, key=mean.__getitem__, reverse=True) if mean[res] > 0]
    fig, (ax,) = _figure(3.8)
    bottom = [0.0] * len(steps)
    for res in resources:  # the busiest at the bottom, where its fraction reads off the axis
        frac = [float(r.get("busy_frac", {}).get(res, 0.0)) for r in run.steps]
        ax.bar(
            steps,
            frac,
            width=0.8 if len(steps) <= MARKERS_UP_TO else 1.0,
            bottom=bottom,
            label=res,
            color=COLOURS.get(res),
        )
        bottom = [b + f for b, f in zip(bottom, frac)]
    ax.set_ylabel("busy fraction of the step")
    handles, labels = ax.get_legend_handles_labels()  # listed top to bottom as stacked
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), title="resource")
    named = Counter(str(r.get("bottleneck")) for r in run.steps)
    top, count = named.most_common(1)[0]
    rows = [(res, f"{mean[res]:.2f}") for res in resources]
    verdict = (
        f'<p class="bottleneck">Bottleneck: {html.escape(top)} (the busiest resource in {count} of '
        f"{len(run.steps)} steps)</p>"
    )
    note = _note(
        "Each bar stacks the fraction of its step's time each resource was busy. Resources work at the same "
        "time, so a stack can exceed 1; the busiest one bounds the step. Table: mean busy fraction."
    )
    alt = f"stacked busy fractions per step of {', '.join(resources) or 'no resource'}; bottleneck {top}"
    return _section(
        "busy", "Where the step time goes: busy fraction per resource", verdict, _png(fig, alt), note, _facts(rows)
    )


def _ssd(run: RunRecord) -> str:
    steps, read, written = _steps(run), _col(run, "ssd_read_gb"), _col(run, "ssd_write_gb")
    fig, (ax,) = _figure(3.4)
    ax.plot(steps, read, marker=_marker(run), color=COLOURS["ssd_read"], label="read", linewidth=3)
    # dashed over a wider solid line: equal reads and writes (a common case) stay both visible
    ax.plot(steps, written, marker=_marker(run), color=COLOURS["ssd_write"], label="written", linestyle="--")
    ax.set_ylabel("SSD GB per step")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best")
    seconds = sum(_col(run, "step_time_s"))
    store = (run.summary or {}).get("store_dirs") or (
        [os.path.join(run.path, "store")] if os.path.isdir(os.path.join(run.path, "store")) else []
    )
    rows = [
        ("read / written, all recorded steps", f"{format_size(sum(read) * 1e9)} / {format_size(sum(written) * 1e9)}"),
        ("per step (mean)", f"{statistics.fmean(read):.3f} GB read, {statistics.fmean(written):.3f} GB written"),
        (
            "SSD writes at this rate",
            ssd_endurance(sum(written) * 1e9, seconds, store) + ("" if store else f"; the store's disk is {NOT_YET}"),
        ),
    ]
    note = _note(
        "The rate: bytes written over the recorded steps' time; drive-writes/day divides a day's writes by the "
        "capacity of the disk holding the store (compare with the drive's rated DWPD)."
    )
    alt = f"SSD GB read and written per step, steps {steps[0]}–{steps[-1]}"
    return _section("ssd", "SSD traffic per step and drive endurance", _png(fig, alt), _facts(rows), note)


def _plan_text(plan: dict[str, Any]) -> str:
    """One line naming the executed plan's knobs (``plan_choice.describe``), or its raw fields when this
    version cannot read them."""
    from fuyou.run.plan_choice import describe
    from fuyou.schedule.plan import Plan

    executed = dict(plan.get("executed") or {})
    try:
        return describe(Plan.from_json(executed))
    except (TypeError, ConfigError):
        return ", ".join(f"{k} {v}" for k, v in executed.items())


def _plan(run: RunRecord) -> str:
    steps, times = _steps(run), _col(run, "step_time_s")
    measured = statistics.median(_steady(times))
    plan = (run.summary or {}).get("plan") or {}
    predicted = plan.get("predicted_step_s")
    fig, (ax,) = _figure(3.2)
    ax.plot(steps, times, marker=_marker(run), color="#4c72b0", label="measured step time")
    if predicted is not None:
        ax.axhline(predicted, color="#c44e52", linestyle="--", label=f"predicted {predicted:.3f} s")
    ax.set_ylabel("seconds per step")
    ax.set_ylim(0, 1.15 * max([t for t in times if math.isfinite(t)] + [predicted or 0.0]))
    ax.legend(loc="best")
    rows = [("measured step time (median of steady steps)", f"{measured:.3f} s")]
    if not run.finished:
        rows.append(("plan", NOT_YET))
    else:
        rows.append(
            (
                "plan chosen by",
                str(plan.get("source", "?")) + (f" (profile {plan['profile']})" if plan.get("profile") else ""),
            )
        )
        rows.append(("plan executed", _plan_text(plan)))
        if predicted is not None:
            rows.append(
                (
                    "predicted step time",
                    f"{predicted:.3f} s, bottleneck {plan.get('predicted_bottleneck')}; measured ÷ predicted = "
                    f"{measured / predicted:.2f}",
                )
            )
        else:
            rows.append(("predicted step time", "none: --plan rules makes no prediction"))
    alt = f"step time per step against the prediction; measured median {measured:.3f} s"
    return _section("plan", "Plan: predicted against measured step time", _png(fig, alt), _facts(rows))


def _memory(run: RunRecord) -> str:
    s = run.summary or {}
    if s.get("peak_rss_bytes") is None or s.get("cpu_memory_bytes") is None:
        return _section("memory", "Host memory: peak against the budget", _facts([("peak host memory", NOT_YET)]))
    peak, budget = int(s["peak_rss_bytes"]), int(s["cpu_memory_bytes"])
    fig, (ax,) = _figure(1.6)
    ax.barh(["budget (--cpu-memory)", "peak RSS"], [budget / 2**30, peak / 2**30], color=["#bbbbbb", "#4c72b0"])
    ax.set_xlabel("GiB")
    rows = [
        ("peak host memory (RSS)", format_size(peak)),
        ("host budget (--cpu-memory)", format_size(budget)),
        ("peak ÷ budget", f"{peak / max(budget, 1):.2f}"),
    ]
    note = _note(
        "The budget bounds Fuyou's own host buffers (pinned buffers, RAM tier, activations); the peak RSS of "
        "the process also counts Python, torch and the other libraries."
    )
    alt = f"peak RSS {format_size(peak)} against the host budget {format_size(budget)}"
    return _section("memory", "Host memory: peak against the budget", _png(fig, alt), _facts(rows), note)


def _table(run: RunRecord) -> str:
    mean = _mean_busy(run)
    resources = [res for res in mean if mean[res] > 0]  # never-busy resources (0.00 throughout) are left out
    every = -(-len(run.steps) // TABLE_ROWS)
    shown = run.steps[::every] + ([run.steps[-1]] if (len(run.steps) - 1) % every else [])
    fixed = ["step", "loss", "lr", "grad norm", "tokens/s", "TFLOPS", "step s", "SSD read GB", "SSD write GB"]

    def num(r: dict[str, Any], key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else ""

    rows = []
    for r in shown:
        cells = [str(r["step"]), num(r, "loss", ".4f"), num(r, "lr", ".3g"), num(r, "grad_norm", ".3f")]
        cells += [num(r, "tokens_per_s", ".1f"), num(r, "tflops", ".4f"), num(r, "step_time_s", ".3f")]
        cells += [num(r, "ssd_read_gb", ".3f"), num(r, "ssd_write_gb", ".3f")]
        cells += [format(r.get("busy_frac", {}).get(res, 0.0), ".2f") for res in resources]
        cells.append(html.escape(str(r.get("bottleneck", ""))))
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f'<th rowspan="2">{html.escape(h)}</th>' for h in fixed)
    head += f'<th colspan="{len(resources)}">busy fraction</th>' if resources else ""
    head += '<th rowspan="2">bottleneck</th></tr><tr>'
    head += "".join(f"<th>{html.escape(res)}</th>" for res in resources)
    what = f"{len(run.steps)} steps" + (f": one in {every} shown, and the last" if every > 1 else "")
    table = f'<div class="scroll"><table class="steps"><tr>{head}</tr>{"".join(rows)}</table></div>'
    opened = " open" if len(run.steps) <= 50 else ""
    return _section("steps", "Every step's numbers", f"<details{opened}><summary>{what}</summary>{table}</details>")
