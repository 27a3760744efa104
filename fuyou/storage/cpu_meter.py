"""CPU seconds spent moving bytes, per stage: what each GB through the store costs the host.

An ``IOBackend`` with a ``CpuMeter`` attached (``IOBackend.meter``; None by default, then nothing is
measured and the I/O tasks pay one attribute test) times every block task with the calling thread's
CPU clock (``time.thread_time``: user + system time of that thread only, so a task waiting for the
GIL or the disk is not charged): opening the file, the ``preadv``/``pwritev`` syscalls, bounce-buffer
copies and the CRC32C. The RAM tier charges its memcpys the same way. Each record goes to a *stage*,
named from the file it touches (``FileHandle.stage``, set by whoever opens it: the store names
``weights`` and ``state`` extents; gradient parking's and activation files' paths name theirs), and
an *op* (``read``, ``write``, ``fsync``, ``copy_in``, ``copy_out``).

Not counted: the Python work around a task (submitting it, futures and callbacks), which a
per-thread view of the process (``bench/bench_io_cpu.py``) adds up separately.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

GRAD_DIR_NAME = "gradients"
"""Directory (under a store directory) of gradient parking's scratch files."""
ACT_DIR_NAME = "activations"
"""Directory (under a store directory) of swapped activations' scratch files."""


@dataclass
class StageCost:
    """CPU seconds, bytes and requests (block tasks or copies) of one (stage, op)."""

    cpu_s: float = 0.0
    nbytes: int = 0
    tasks: int = 0

    @property
    def cpu_s_per_gb(self) -> float:
        """CPU seconds per 10⁹ bytes (NaN when no bytes were moved)."""
        return self.cpu_s / (self.nbytes / 1e9) if self.nbytes else float("nan")


def stage_of_path(path: str) -> str:
    """The stage a file without an explicit ``stage`` belongs to, from its path: ``grad_park`` for
    gradient parking's files, ``activations`` for swapped activations, else ``other``."""
    parent = os.path.basename(os.path.dirname(path))
    if parent == GRAD_DIR_NAME:
        return "grad_park"
    if parent == ACT_DIR_NAME:
        return "activations"
    return "other"


class CpuMeter:
    """Thread-safe accumulator of ``StageCost`` per (stage, op); see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._costs: dict[tuple[str, str], StageCost] = {}

    def add(self, stage: str, op: str, cpu_s: float, nbytes: int) -> None:
        """Charge ``cpu_s`` CPU seconds and ``nbytes`` bytes (one task) to (``stage``, ``op``)."""
        with self._lock:
            c = self._costs.get((stage, op))
            if c is None:
                c = self._costs[(stage, op)] = StageCost()
            c.cpu_s += cpu_s
            c.nbytes += nbytes
            c.tasks += 1

    def snapshot(self) -> dict[tuple[str, str], StageCost]:
        """A copy of the costs so far, keyed by (stage, op)."""
        with self._lock:
            return {k: StageCost(c.cpu_s, c.nbytes, c.tasks) for k, c in self._costs.items()}

    def reset(self) -> None:
        """Forget everything counted so far."""
        with self._lock:
            self._costs.clear()

    @staticmethod
    def diff(after: dict[tuple[str, str], StageCost], before: dict[tuple[str, str], StageCost]) -> dict:
        """``after − before`` per (stage, op) as plain data: ``{"stage.op": {cpu_s, bytes, tasks,
        cpu_s_per_gb}}``, leaving out entries that did not change."""
        out = {}
        for key, a in sorted(after.items()):
            b = before.get(key, StageCost())
            d = StageCost(a.cpu_s - b.cpu_s, a.nbytes - b.nbytes, a.tasks - b.tasks)
            if d.tasks:
                out[".".join(key)] = {
                    "cpu_s": d.cpu_s,
                    "bytes": d.nbytes,
                    "tasks": d.tasks,
                    "cpu_s_per_gb": d.cpu_s_per_gb,
                }
        return out
