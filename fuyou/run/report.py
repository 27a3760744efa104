"""What a run shows a person: a live progress bar and an end-of-run table (rich)."""

from __future__ import annotations

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
        ssd = (rec["ssd_read_gb"] + rec["ssd_write_gb"]) / max(rec["step_time_s"], 1e-9)
        info = (
            f"loss {rec['loss']:.3f} | {rec['tokens_per_s']:.0f} tok/s | {rec['tflops']:.2f} TFLOPS | "
            f"SSD {ssd:.2f} GB/s | bound: {rec['bottleneck']}"
        )
        self._bar.update(self._task, advance=1, info=info)

    def __exit__(self, *exc: object) -> None:
        if self._bar:
            self._bar.__exit__(*exc)


def summary_table(s: dict) -> None:
    """Print the end-of-run table, including what the SSD writes mean for drive endurance."""
    from rich.console import Console
    from rich.table import Table

    per_day = s["ssd_write_bytes"] / max(s["wall_s"], 1e-9) * 86400
    disk = shutil.disk_usage(s["store_dirs"][0]).total if s.get("store_dirs") else 0
    t = Table(title="Fuyou run", show_header=False)
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
        ("SSD read / written", f"{format_size(s['ssd_read_bytes'])} / {format_size(s['ssd_write_bytes'])}"),
        (
            "SSD writes at this rate",
            f"{format_size(per_day)}/day"
            + (f" = {per_day / disk:.1f} drive-writes/day of this {format_size(disk)} disk" if disk else ""),
        ),
        ("model written to", s.get("output", "?")),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
