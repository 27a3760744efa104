"""Per-operation timeline: spans on named resources, step summaries, Chrome-trace/Perfetto export.

Resources: ``ssd_read``, ``ssd_write``, ``h2d``, ``d2h`` (copies between host and device, weights,
gradients and swapped activations), ``compute``, ``adam``, ``comm`` (collectives between data-parallel
ranks) and ``ram_copy`` (host-memory copies: the RAM tier's reads and writes, new weights handed from
Adam's buffer to a read; they never cross PCIe). A resource's busy time is the *union* of its spans
(several reads in flight at once count once), and the bottleneck is the busiest resource. Spans are
recorded from any thread.

Bytes (``MOVED``) are counted by the step they serve, not by when they land: each transfer is counted when
it is issued, in the ledger of the step the engine is running then (``begin_step``), or of the step a
later stage names (``track``'s ``step``: the Adam stage's reads and writes of a step's update, issued after
that step's end, a parked gradient's read back included); a transfer issued outside any step (an evaluation, a flush before a checkpoint) counts
in the ``None`` ledger. A step's figures are final once every transfer serving it has been issued, so two
identical runs report the same bytes per step, whatever the timing (``take_bytes``).

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
"""Resources whose bytes a step reports (``take_bytes``)."""
_KEPT_LEDGERS = 1024
"""Steps whose bytes nobody took that a timeline keeps (the most recent)."""
_UNSET = object()


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
        self._ledger: dict[int | None, dict[str, int]] = {}
        """Bytes issued per resource of ``MOVED``, by the step they serve (None: outside any step)."""
        self._steps = 0
        """Steps begun so far (``begin_step``): the ledgers' keys."""
        self._serving: int | None = None
        self._lock = threading.Lock()
        self.origin = time.perf_counter()

    # ------------------------------------------------------------------ bytes by the step they serve
    def begin_step(self) -> int:
        """The engine starts a step: transfers issued from now on serve it (unless ``track`` names
        another). Returns the step's ledger key (1, 2, … in this timeline)."""
        with self._lock:
            self._steps += 1
            self._serving = self._steps
            self._ledger.setdefault(self._steps, dict.fromkeys(MOVED, 0))
            if len(self._ledger) > _KEPT_LEDGERS:  # figures nobody took: keep the recent ones
                del self._ledger[min(k for k in self._ledger if k is not None)]
        return self._steps

    @property
    def steps(self) -> int:
        """Steps begun so far: the latest step's ledger key (0: none)."""
        return self._steps

    def end_step(self) -> None:
        """The engine's step is over: transfers issued from now on serve no step (unless ``track`` names one)."""
        self._serving = None

    @property
    def serving(self) -> int | None:
        """The ledger key transfers issued now count in (None: between steps)."""
        return self._serving

    def _count(self, key: int | None, resource: str, nbytes: int) -> None:
        if resource in MOVED and nbytes:
            with self._lock:
                self._ledger.setdefault(key, dict.fromkeys(MOVED, 0))[resource] += nbytes

    def take_bytes(self, key: int | None) -> dict[str, int]:
        """Bytes per resource of ``MOVED`` counted for step ``key`` (None: outside any step) since the
        last take, which now count as reported. Final once every transfer serving the step has been
        issued (the caller waits for that: ``Engine.step_io``)."""
        with self._lock:
            got = self._ledger.pop(key, None) or dict.fromkeys(MOVED, 0)
        return dict(got)

    def add(
        self,
        resource: str,
        label: str,
        t0: float,
        t1: float,
        nbytes: int = 0,
        issued: float | None = None,
        counted: bool = False,
    ) -> None:
        """Record a finished span (``issued``: a device span's issue time, see ``Span``). Its bytes count
        in the ledger of the step served now, unless already ``counted`` at issue (``track``,
        ``device_span``)."""
        if not counted:
            self._count(self.serving, resource, nbytes)
        with self._lock:
            self.spans.append(Span(resource, label, t0, t1, nbytes, issued))

    @contextmanager
    def device_span(
        self, resource: str, label: str, backend: Backend, stream: Any | None, nbytes: int = 0
    ) -> Iterator[None]:
        """Time the work the body issues on ``stream`` (None: the current stream) as the device runs it:
        from when the device reaches the work issued before the body to when it finishes the body's,
        less the waits the body brackets with ``gap``."""
        self._count(self.serving, resource, nbytes)
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
                self.add(resource, label, t0, t1, nbytes, issued, counted=True)

    def track(self, fut: Future, resource: str, label: str, nbytes: int = 0, step: Any = _UNSET) -> Future:
        """Record ``fut`` as a span from now until it completes, its bytes counted now (issued) for
        ``step`` (default: the step served on this thread, ``serving``); returns ``fut``."""
        self._count(self.serving if step is _UNSET else step, resource, nbytes)
        t0 = time.perf_counter()
        fut.add_done_callback(lambda _: self.add(resource, label, t0, time.perf_counter(), nbytes, counted=True))
        return fut

    def summary(self, t0: float, t1: float) -> dict:
        """Busy seconds per resource of the step [t0, t1], the bottleneck and the wall time (bytes: by
        the step they serve, ``take_bytes``).

        Host spans count within [t0, t1]. Device spans count in the step that issued them (issued in
        [t0, t1)), whole: those issued before ``t1`` are waited for first, so a copy the step issued that
        lands after ``t1`` counts in this step, not in the next."""
        self.resolve(before=t1)
        with self._lock:
            spans = [_window(s, t0, t1) for s in self.spans]
        busy = {r: union_length([iv for res, iv in spans if res == r and iv is not None]) for r in RESOURCES}
        wall = t1 - t0
        bottleneck = max(busy, key=busy.__getitem__)
        return {
            "wall_s": wall,
            "busy_s": busy,
            "busy_frac": {r: b / wall for r, b in busy.items()},
            "bottleneck": bottleneck,
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
        flight stay, and so do the bytes not yet taken (``take_bytes``)."""
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
