"""Per-operation timeline: spans on named resources, step summaries, Chrome-trace/Perfetto export.

Resources: ``ssd_read``, ``ssd_write``, ``h2d``, ``d2h`` (copies between host and device, weights,
gradients and swapped activations), ``compute``, ``adam``, ``comm`` (collectives between data-parallel
ranks) and ``ram_copy`` (host-memory copies: the RAM tier's reads and writes, new weights handed from
Adam's buffer to a read; they never cross PCIe). A resource's busy time is the *union* of its spans
(several reads in flight at once count once), and the bottleneck is the busiest resource. Spans are
recorded from any thread.

Work a device runs asynchronously (compute, host↔device copies) is timed by the device:
``device_span`` records a pair of clock events (``Backend.clock``: CUDA timing events on a GPU,
the moment a stream's thread ran the work under the asynchronous CPU backend, the host clock on
the plain CPU backend, where such work is synchronous) and the span is resolved — its times read
from the events — when they have completed. Host clocks around an asynchronous call would time only
its launch. A device span belongs to the step that issued it: ``summary`` waits for the device spans
issued before the step's end and counts them whole, even the part the device runs after that end (a
step's last copies off the device), and no later step counts them. A wait of the span's stream for
another stream (or for the host) inside the body is not the span's work: ``gap`` cuts it out.
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

RESOURCES = ("ssd_read", "ssd_write", "h2d", "d2h", "compute", "adam", "comm", "ram_copy")
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
    issued: float | None = None
    """Device-timed spans: when the host issued the work (``perf_counter``), which decides the step it
    counts in (``Timeline.summary``); None for host spans."""


@dataclass(eq=False)
class _Open:
    """A device span whose body is running: its stream and the start of its current segment."""

    resource: str
    label: str
    backend: Backend
    stream: Any
    nbytes: int
    start: Event
    issued: float


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
        self._device: list[tuple[str, str, int, Event, Event, float]] = []
        """Device-timed spans whose events have not been read yet (``resolve``), with their issue time."""
        self._open: list[_Open] = []
        """The device spans whose bodies run now, from any thread (``gap``: on a GPU autograd runs the
        backward's hooks on its own device thread, not on the thread that opened the compute span)."""
        self._moved: dict[str, int] = dict.fromkeys(MOVED, 0)
        """Bytes of every span recorded so far, per resource of ``MOVED`` (``clear`` keeps them)."""
        self._reported: dict[str, int] = dict.fromkeys(MOVED, 0)
        """``_moved`` at the last ``summary``."""
        self._lock = threading.Lock()
        self.origin = time.perf_counter()

    def add(
        self, resource: str, label: str, t0: float, t1: float, nbytes: int = 0, issued: float | None = None
    ) -> None:
        """Record a finished span (``issued``: a device span's issue time, see ``Span``)."""
        with self._lock:
            self.spans.append(Span(resource, label, t0, t1, nbytes, issued))
            if resource in self._moved:
                self._moved[resource] += nbytes

    @contextmanager
    def device_span(
        self, resource: str, label: str, backend: Backend, stream: Any | None, nbytes: int = 0
    ) -> Iterator[None]:
        """Time the work the body issues on ``stream`` (None: the current stream) as the device runs it:
        from when the device reaches the work issued before the body to when it finishes the body's,
        less the waits the body brackets with ``gap``."""
        span = _Open(resource, label, backend, stream, nbytes, backend.clock(stream), time.perf_counter())
        with self._lock:
            self._open.append(span)
        try:
            yield
        finally:
            with self._lock:
                self._open.remove(span)
            self._close(span)

    def _close(self, span: _Open) -> None:
        """End the current segment of ``span`` (a clock event after the work issued so far)."""
        end = span.backend.clock(span.stream)
        with self._lock:
            self._device.append((span.resource, span.label, span.nbytes, span.start, end, span.issued))

    @contextmanager
    def gap(self, stream: Any | None) -> Iterator[None]:
        """The body makes ``stream`` wait (for another stream's event, or for the host): the device
        spans open on ``stream`` (whichever thread opened them) end before it and start again after it,
        so the wait is not counted as their work. Outside such spans: nothing."""
        with self._lock:
            spans = [sp for sp in self._open if _same(sp.stream, stream)]
        for sp in spans:
            self._close(sp)
        try:
            yield
        finally:
            for sp in spans:
                sp.start = sp.backend.clock(sp.stream)

    def resolve(self, before: float | None = None) -> None:
        """Turn device-timed spans whose events have completed into spans (the rest wait); with
        ``before``, first wait for those issued before then (a step's, at its end)."""
        with self._lock:
            pending, self._device = self._device, []
        for item in pending:
            resource, label, nbytes, start, end, issued = item
            if before is not None and issued < before:
                _settle(end)
            t1 = end.when()
            t0 = start.when() if t1 is not None else None
            if t0 is None or t1 is None:
                with self._lock:
                    self._device.append(item)
            else:
                self.add(resource, label, t0, t1, nbytes, issued)

    def track(self, fut: Future, resource: str, label: str, nbytes: int = 0) -> Future:
        """Record ``fut`` as a span from now until it completes; returns ``fut``."""
        t0 = time.perf_counter()
        fut.add_done_callback(lambda _: self.add(resource, label, t0, time.perf_counter(), nbytes))
        return fut

    def summary(self, t0: float, t1: float) -> dict:
        """Busy seconds per resource of the step [t0, t1], the bottleneck, the wall time, and the bytes
        each resource of ``MOVED`` moved in the spans recorded since the previous summary.

        Host spans count within [t0, t1]. Device spans count in the step that issued them (issued in
        [t0, t1)), whole: those issued before ``t1`` are waited for first, so a copy the step issued that
        lands after ``t1`` counts in this step, not in the next. Bytes go by completion, so each byte
        counts in exactly one summary: a write that outlives one step's window, or finishes between two
        steps, counts in the next."""
        self.resolve(before=t1)
        with self._lock:
            spans = [_window(s, t0, t1) for s in self.spans]
            moved = {r: self._moved[r] - self._reported[r] for r in MOVED}
            self._reported = dict(self._moved)
        busy = {r: union_length([iv for res, iv in spans if res == r and iv is not None]) for r in RESOURCES}
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

    def take_moved(self) -> dict[str, int]:
        """Bytes each resource of ``MOVED`` moved since the previous ``summary`` or ``take_moved``, which
        now count as reported (a run's tail: what landed after its last step's summary)."""
        with self._lock:
            moved = {r: self._moved[r] - self._reported[r] for r in MOVED}
            self._reported = dict(self._moved)
        return moved

    def clear(self) -> None:
        """Forget recorded spans (long runs keep only the recent ones); device-timed spans still in
        flight stay, and so do the byte counts of the next ``summary``."""
        with self._lock:
            self.spans.clear()


def _window(s: Span, t0: float, t1: float) -> tuple[str, tuple[float, float] | None]:
    """(resource, the part of ``s`` that counts in the step [t0, t1], or None): a host span's overlap
    with the step, a device span whole if the step issued it."""
    if s.issued is not None:
        return s.resource, (s.t0, s.t1) if t0 <= s.issued < t1 else None
    return s.resource, (max(s.t0, t0), min(s.t1, t1)) if s.t1 > t0 and s.t0 < t1 else None


def _same(a: Any, b: Any) -> bool:
    """Whether two stream handles name the same stream (CUDA streams compare by value, others by identity)."""
    return a is b or (a is not None and b is not None and a == b)


def _settle(ev: Event) -> None:
    """Wait until the device has reached ``ev``. A failure of the work is not the timeline's to
    report (the data path that waits on its own events raises it): the span then stays unresolved."""
    try:
        ev.wait()
    except Exception:  # noqa: BLE001, S110 - surfaced by the data path's own wait
        pass
