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

No buffer is held longer than before: a copy happens only while Adam holds the buffer anyway. The
copies are timed as ``h2d`` spans (like the RAM tier's) and charged to the CPU meter as stage
``ram_handoff``. Thread-safe: publish and retire run on the Adam stage's threads, claims on the
loader's.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import torch

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

    def expect(self, b: int) -> None:
        """An update of block ``b`` was submitted: claims of ``b`` wait for its ``publish``."""
        with self._lock:
            self._expected.add(b)

    def publish(self, b: int, name: str, data: torch.Tensor) -> None:
        """Block ``b``'s new weights (extent ``name``) are complete in ``data`` (uint8, exactly the
        extent's bytes); serve the claims waiting for them. ``data`` must stay valid until ``retire(b)``."""
        with self._lock:
            self._held[b] = (name, data)
            waiting = self._claims.pop(b, [])
            for dst, _ in waiting:
                self._copy(name, data, dst)
        for _, fut in waiting:
            fut.set_result(None)

    def retire(self, b: int, error: BaseException | None = None) -> None:
        """Block ``b``'s buffer is about to be released (its write landed, or the update failed with
        ``error``): no more copies from it; claims still waiting fail with ``error``."""
        with self._lock:
            self._held.pop(b, None)
            self._expected.discard(b)
            waiting = self._claims.pop(b, [])
        for _, fut in waiting:
            fut.set_exception(error or RuntimeError(f"the update of block {b} ended without its new weights"))

    def claim(self, b: int, dst: torch.Tensor) -> Future | None:
        """Block ``b``'s new weights into ``dst`` (uint8 host tensor, ≥ the extent's bytes): a future for
        the copy, or None when no update of ``b`` is in flight (read the store instead)."""
        with self._lock:
            held = self._held.get(b)
            if held is not None:
                self._copy(held[0], held[1], dst)
                return done_future()
            if b not in self._expected:
                return None
            fut: Future = Future()
            self._claims.setdefault(b, []).append((dst, fut))
            return fut

    def _copy(self, name: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the extent's bytes (``src``, all of it) to the start of ``dst`` and account for them."""
        n = src.numel()
        t0, c0 = time.perf_counter(), time.thread_time()
        dst[:n].copy_(src[:n])
        self.timeline.add("h2d", f"adam→host {name}", t0, time.perf_counter(), n)
        meter = self.io.meter
        if meter is not None:
            meter.add("ram_handoff", "copy_out", time.thread_time() - c0, n)
