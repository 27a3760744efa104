"""What a run shows a person: a live progress bar and an end-of-run table (rich)."""

from __future__ import annotations

import os
import shutil
from typing import Any

from fuyou.units import format_size


def peak_rss() -> int:
    """Peak resident memory of this process in bytes (VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Progress:
    """step/total, loss, tokens/s, TFLOPS, SSD GB/s and the bottleneck, live."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled
        self._bar: Any = None
        self._ssd = ""

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

            self._bar = Bar(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total, info="loading first blocks…")
        return self

    def advance_to(self, step: int) -> None:
        """Start the bar at ``step`` (a resumed run)."""
        if self._bar and step:
            self._bar.update(self._task, completed=step)

    def update(self, rec: dict) -> None:
        """Advance one step with its metrics record."""
        if not self._bar:
            return
        info = (
            f"loss {rec['loss']:.3f} | {rec['tokens_per_s']:.0f} tok/s | {rec['tflops']:.2f} TFLOPS | "
            f"{self._ssd}bound: {rec['bottleneck']}"
        )
        self._bar.update(self._task, advance=1, info=info)

    def ssd_rate(self, rec: dict) -> None:
        """Show the SSD rate of ``rec``, a metrics line with its bytes (a step behind the bar: a step's
        bytes are final once its update has issued them)."""
        self._ssd = f"SSD {(rec['ssd_read_gb'] + rec['ssd_write_gb']) / max(rec['step_time_s'], 1e-9):.2f} GB/s | "

    def __exit__(self, *exc: object) -> None:
        if self._bar:
            self._bar.__exit__(*exc)


def _disk_bytes(path: str) -> int:
    """Capacity in bytes of the filesystem holding ``path`` (its nearest existing parent: a store
    directory may be a ``{rank}`` template or gone); 0 if none can be read."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).total
    except OSError:
        return 0


def ssd_endurance(write_bytes: float, seconds: float, store_dirs: list[str]) -> str:
    """What writing ``write_bytes`` to the store in ``seconds`` means for the drive: bytes per day at
    this rate and, where the disk holding the first of ``store_dirs`` is known, drive-writes per day
    (bytes per day ÷ the disk's capacity), e.g. ``1.2 TiB/day = 0.6 drive-writes/day of this 1.8 TiB disk``."""
    per_day = write_bytes / max(seconds, 1e-9) * 86400
    disk = _disk_bytes(store_dirs[0]) if store_dirs else 0
    return f"{format_size(per_day)}/day" + (
        f" = {per_day / disk:.1f} drive-writes/day of this {format_size(disk)} disk" if disk else ""
    )


def _device_rows(s: dict) -> list[tuple[str, str]]:
    """The device-memory rows of the summary (runs recorded before these figures have none)."""
    if s.get("device_peak_bytes") is None:
        return []
    pred = s.get("device_predicted_bytes")
    said = f" (predicted {format_size(pred)})" if pred else ""
    return [
        ("peak device memory", format_size(s["device_peak_bytes"]) + said),
        ("device budget (--gpu-memory)", _budget(s["device_budget_bytes"])),
    ]


def _budget(nbytes: int) -> str:
    """A device budget as a size, or "none given" for the CPU backend's unbounded default (2⁶²)."""
    return "none given" if nbytes >= 2**62 else format_size(nbytes)


def _per_param(s: dict) -> str:
    """`` (R + W B per parameter per step; planner R' + W', optimizer state F)`` of a run summary (the
    planner's figure where it planned the run: a steady step's, which the first step's reads exceed by
    the weights a steady step is handed from the last update), or "" without the counts (a summary from
    before they were recorded, a run that took no step)."""
    steps = s.get("steps", 0) - (s.get("resumed_from_step") or 0)
    n = s.get("stored_params")
    if not n or steps <= 0:
        return ""
    read, written = s["ssd_read_bytes"] / steps / n, s["ssd_write_bytes"] / steps / n
    plan = s.get("plan") or {}
    pr, pw = plan.get("predicted_ssd_read_bytes"), plan.get("predicted_ssd_write_bytes")
    said = f"; planner {pr / n:.1f} + {pw / n:.1f}" if pr is not None and pw is not None else ""
    fmt = s.get("optimizer_state", "fp32")
    return f" ({read:.1f} + {written:.1f} B per parameter per step{said}, optimizer state {fmt})"


def _outside_rows(s: dict) -> list[tuple[str, str]]:
    """The row of SSD bytes moved outside the steps (import, evaluations, checkpoints' flushes), if any
    were recorded."""
    read, written = s.get("ssd_outside_read_bytes"), s.get("ssd_outside_write_bytes")
    if not read and not written:
        return []
    return [("SSD read / written outside the steps", f"{format_size(read or 0)} / {format_size(written or 0)}")]


def summary_table(s: dict, run_dir: str | None = None) -> None:
    """Print the end-of-run table, including what the SSD writes mean for drive endurance, and where
    the run's one-page report (``fuyou report``) and TensorBoard logs are."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Fuyou run", show_header=False)
    t.add_column()
    t.add_column(overflow="fold")  # long paths wrap instead of ending in "…": they are there to be copied
    rows = [
        ("steps", str(s["steps"])),
        ("tokens", f"{s['tokens']:,}"),
        ("wall time", f"{s['wall_s']:.1f} s"),
        ("tokens/s", f"{s['tokens_per_s']:.1f}"),
        ("loss (first → last step)", f"{s['first_loss']:.4f} → {s['last_loss']:.4f}"),
    ]
    if s.get("eval_loss_before") is not None:
        rows.append(("held-out loss (before → after)", f"{s['eval_loss_before']:.4f} → {s['eval_loss_after']:.4f}"))
    rows += [
        ("peak host memory (RSS)", format_size(s["peak_rss_bytes"])),
        ("host budget (--cpu-memory)", format_size(s["cpu_memory_bytes"])),
        *_device_rows(s),
        (
            "SSD read / written",
            f"{format_size(s['ssd_read_bytes'])} / {format_size(s['ssd_write_bytes'])}" + _per_param(s),
        ),
        ("SSD writes at this rate", ssd_endurance(s["ssd_write_bytes"], s["wall_s"], s.get("store_dirs") or [])),
        *_outside_rows(s),
        ("model written to", s.get("output", "?")),
    ]
    if run_dir:
        rows.append(("report", f"fuyou report {run_dir}"))
    if s.get("tensorboard"):
        rows.append(("tensorboard", f"tensorboard --logdir {s['tensorboard']}"))
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
