"""Per-operation timeline: spans on named resources, step summaries, Chrome-trace/Perfetto export.

Resources: ``ssd_read``, ``ssd_write``, ``h2d``, ``d2h``, ``compute``, ``adam``, ``comm`` (collectives between
data-parallel ranks). A resource's busy
time is the *union* of its spans (several reads in flight at once count once), and the bottleneck
is the busiest resource. Spans are recorded from any thread.

Work a device runs asynchronously (compute, host↔device copies) is timed by the device:
``device_span`` records a pair of clock events (``Backend.clock``: CUDA timing events on a GPU,
the moment a stream's thread ran the work under the asynchronous CPU backend, the host clock on
the plain CPU backend, where such work is synchronous) and the span is resolved — its times read
from the events — when they have completed, at the latest by ``summary`` at step end. Host clocks
around an asynchronous call would time only its launch.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fuyou.device.base import Backend, Event

RESOURCES = ("ssd_read", "ssd_write", "h2d", "d2h", "compute", "adam", "comm")
MOVED = ("ssd_read", "ssd_write", "comm")
"""Resources whose bytes a step reports (``summary``)."""


@dataclass(frozen=True)
class Span:
    """One operation: resource, label, start and end (seconds, perf_counter clock), bytes moved."""

    resource: str
    label: str
    t0: float
    t1: float
    nbytes: int = 0


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length (s) covered by possibly overlapping intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class Timeline:
    """Collects spans; ``summary`` gives busy time per resource between two instants."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._device: list[tuple[str, str, int, Event, Event]] = []
        """Device-timed spans whose events have not been read yet (``resolve``)."""
        self._moved: dict[str, int] = dict.fromkeys(MOVED, 0)
        """Bytes of every span recorded so far, per resource of ``MOVED`` (``clear`` keeps them)."""
        self._reported: dict[str, int] = dict.fromkeys(MOVED, 0)
        """``_moved`` at the last ``summary``."""
        self._lock = threading.Lock()
        self.origin = time.perf_counter()

    def add(self, resource: str, label: str, t0: float, t1: float, nbytes: int = 0) -> None:
        """Record a finished span."""
        with self._lock:
            self.spans.append(Span(resource, label, t0, t1, nbytes))
            if resource in self._moved:
                self._moved[resource] += nbytes

    @contextmanager
    def device_span(
        self, resource: str, label: str, backend: Backend, stream: Any | None, nbytes: int = 0
    ) -> Iterator[None]:
        """Time the work the body issues on ``stream`` (None: the current stream) as the device runs it:
        from when the device reaches the work issued before the body to when it finishes the body's."""
        start = backend.clock(stream)
        try:
            yield
        finally:
            end = backend.clock(stream)
            with self._lock:
                self._device.append((resource, label, nbytes, start, end))

    def resolve(self) -> None:
        """Turn device-timed spans whose events have completed into spans (the rest wait)."""
        with self._lock:
            pending, self._device = self._device, []
        for item in pending:
            resource, label, nbytes, start, end = item
            t1 = end.when()
            t0 = start.when() if t1 is not None else None
            if t0 is None or t1 is None:
                with self._lock:
                    self._device.append(item)
            else:
                self.add(resource, label, t0, t1, nbytes)

    def track(self, fut: Future, resource: str, label: str, nbytes: int = 0) -> Future:
        """Record ``fut`` as a span from now until it completes; returns ``fut``."""
        t0 = time.perf_counter()
        fut.add_done_callback(lambda _: self.add(resource, label, t0, time.perf_counter(), nbytes))
        return fut

    def summary(self, t0: float, t1: float) -> dict:
        """Busy seconds per resource within [t0, t1], the bottleneck, the wall time, and the bytes each
        resource of ``MOVED`` moved in the spans recorded since the previous summary (device-timed
        spans resolved first). Bytes go by completion, so each byte counts in exactly one summary: a
        write that outlives one step's window, or finishes between two steps, counts in the next."""
        self.resolve()
        with self._lock:
            spans = [s for s in self.spans if s.t1 > t0 and s.t0 < t1]
            moved = {r: self._moved[r] - self._reported[r] for r in MOVED}
            self._reported = dict(self._moved)
        busy = {r: union_length([(max(s.t0, t0), min(s.t1, t1)) for s in spans if s.resource == r]) for r in RESOURCES}
        wall = t1 - t0
        bottleneck = max(busy, key=busy.__getitem__)
        return {
            "wall_s": wall,
            "busy_s": busy,
            "busy_frac": {r: b / wall for r, b in busy.items()},
            "bottleneck": bottleneck,
            "ssd_read_bytes": moved["ssd_read"],
            "ssd_write_bytes": moved["ssd_write"],
            "comm_bytes": moved["comm"],
        }

    def to_chrome_trace(self, path: str) -> None:
        """Write all spans as Chrome-trace JSON (open in ui.perfetto.dev or chrome://tracing), one row per resource."""
        self.resolve()
        with self._lock:
            spans = list(self.spans)
        tid = {r: i for i, r in enumerate(RESOURCES)}
        events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": r}} for r, i in tid.items()]
        events += [
            {
                "name": s.label,
                "cat": s.resource,
                "ph": "X",
                "pid": 1,
                "tid": tid.get(s.resource, len(tid)),
                "ts": (s.t0 - self.origin) * 1e6,
                "dur": (s.t1 - s.t0) * 1e6,
                "args": {"bytes": s.nbytes},
            }
            for s in spans
        ]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    def clear(self) -> None:
        """Forget recorded spans (long runs keep only the recent ones); device-timed spans still in
        flight stay, and so do the byte counts of the next ``summary``."""
        with self._lock:
            self.spans.clear()
