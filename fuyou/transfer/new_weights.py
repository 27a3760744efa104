"""Adam's new compute weights handed to the next read of their block in host memory, not via the SSD.

With the clipping schedule the last step's Adam(b) finishes while this step's forward is about to
read block b's weights. Instead of waiting for Adam's SSD write of ``w/<b>`` and reading it back,
the weight loader *claims* them: a memcpy from Adam's new-weights buffer into the loader's host
buffer. Per block:

* ``expect`` — an update of b was submitted (``AdamStage.update``): a claim from now on waits for it;
* ``publish`` — every chunk's kernel is done, the buffer holds the new weights: waiting claims are
  served, later ones copy at once;
* ``retire`` — the SSD write of ``w/<b>`` landed (or the update failed: waiting claims get its error),
  just before the buffer returns to the pool; a later claim returns None and the loader reads the
  store as before.

An update submitted with ``hold`` (the clipping schedule's, whose blocks the next forward reads in
order) keeps its buffer past the write until the first claim has copied it, so every forward read is
handed over even when Adam runs ahead: at most the new-weights buffers' count of blocks wait, and
the Adam stage, out of buffers, waits for the forward — which claims in the order Adam publishes, so
it never waits for a block behind a held one. ``drop`` (``settle``, before waiting for the updates)
gives back whatever is still held. Copies are timed as ``ram_copy`` spans (like the RAM tier's) and
charged to the CPU meter as stage ``ram_handoff``. Thread-safe: publish and retire run on the Adam
stage's threads, claims on the loader's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from fuyou.device.host_threads import host_copy
from fuyou.storage.io_base import IOBackend
from fuyou.timeline import Timeline
from fuyou.transfer.futures import done_future


class NewWeights:
    """Hand-off of published new-weight buffers to claiming reads; see the module docstring."""

    def __init__(self, timeline: Timeline, io: IOBackend) -> None:
        self.timeline, self.io = timeline, io
        self._lock = threading.Lock()
        self._expected: set[int] = set()
        self._held: dict[int, tuple[str, torch.Tensor]] = {}
        self._claims: dict[int, list[tuple[torch.Tensor, Future]]] = {}
        self._hold: set[int] = set()
        """Blocks whose buffer stays past its write until the first claim."""
        self._deferred: dict[int, Callable[[], None]] = {}
        """Written, held, not yet claimed: block → what returns its buffer to the pool."""

    def expect(self, b: int, hold: bool = False) -> None:
        """An update of block ``b`` was submitted: claims of ``b`` wait for its ``publish``; ``hold``:
        its buffer stays until the first claim (see the module docstring)."""
        with self._lock:
            self._expected.add(b)
            if hold:
                self._hold.add(b)

    def publish(self, b: int, name: str, data: torch.Tensor) -> None:
        """Block ``b``'s new weights (extent ``name``) are complete in ``data`` (uint8, exactly the
        extent's bytes); serve the claims waiting for them. ``data`` must stay valid until ``retire(b)``."""
        with self._lock:
            self._held[b] = (name, data)
            waiting = self._claims.pop(b, [])
            for dst, _ in waiting:
                self._copy(name, data, dst)
            if waiting:
                self._hold.discard(b)
        for _, fut in waiting:
            fut.set_result(None)

    def retire(self, b: int, error: BaseException | None, release: Callable[[], None]) -> None:
        """Block ``b``'s write landed (or the update failed with ``error``): ``release`` returns its
        buffer to the pool — now, or at its first claim if it is held and unclaimed. Claims still
        waiting fail with ``error``."""
        with self._lock:
            if error is None and b in self._hold and b in self._held:
                self._deferred[b] = release
                return
            self._forget(b)
            waiting = self._claims.pop(b, [])
        release()
        for _, fut in waiting:
            fut.set_exception(error or RuntimeError(f"the update of block {b} ended without its new weights"))

    def claim(self, b: int, dst: torch.Tensor) -> Future | None:
        """Block ``b``'s new weights into ``dst`` (uint8 host tensor, ≥ the extent's bytes): a future for
        the copy, or None when no update of ``b`` is in flight (read the store instead)."""
        with self._lock:
            held = self._held.get(b)
            if held is None:
                if b not in self._expected:
                    return None
                fut: Future = Future()
                self._claims.setdefault(b, []).append((dst, fut))
                return fut
            self._copy(held[0], held[1], dst)
            self._hold.discard(b)
            release = self._deferred.pop(b, None)
            if release is not None:  # written before this claim: its buffer waited only for it
                self._forget(b)
        if release is not None:
            release()
        return done_future()

    def drop(self) -> None:
        """Hold nothing any more: buffers waiting for a claim go back to the pool now, updates still in
        flight release theirs at their write."""
        with self._lock:
            deferred, self._deferred = self._deferred, {}
            self._hold.clear()
            for b in deferred:
                self._forget(b)
        for release in deferred.values():
            release()

    def _forget(self, b: int) -> None:
        """(Lock held.) No more copies of block ``b`` from Adam's buffer."""
        self._held.pop(b, None)
        self._expected.discard(b)
        self._hold.discard(b)

    def _copy(self, name: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the extent's bytes (``src``, all of it) to the start of ``dst`` and account for them."""
        n = src.numel()
        t0, c0 = time.perf_counter(), time.thread_time()
        host_copy(dst[:n], src[:n])
        self.timeline.add("ram_copy", f"adam→host {name}", t0, time.perf_counter(), n)
        meter = self.io.meter
        if meter is not None:
            meter.add("ram_handoff", "copy_out", time.thread_time() - c0, n)
