"""Parked gradients: where a finished block gradient waits until the step may update it.

The clipping schedule (``overlap_next_forward``) cannot update any block before backward ends (the
clipping coefficient needs the global norm), so every block's gradient waits — 2 B/param in bf16,
4 in fp32, 350 GB for a 175B model. ``Plan.park_ram_blocks`` = N keeps blocks 0…N−1's in host RAM
(one pool buffer each, class ``park/<b>``); later blocks' go to SSD:

* park — the device gradient is copied into one of the two gradient buffers (``grads``:
  ``fuyou.transfer.gradients``) and written, asynchronously and checksummed, to a scratch file of
  that block (``<ssd>/gradients/``, striped over the store directories, allocated once, reused every
  step); the buffer returns to the pool when the write lands. The training thread only waits when
  both buffers are in flight.
* read back — the Adam pass asks for the gradient on its feeder thread (``AdamStage.update`` takes a
  callable): a ``grads`` buffer is taken, the file read into it (checksums verified), and Adam starts
  when the read lands, so reads of later blocks overlap Adam of earlier ones.

A block's file is written at most once per step and read back before the next step parks into it:
the last step's Adam overlaps this step's backward, but block b's backward runs on weights that Adam(b)
produced (the weight loader's gate or hand-off), so Adam(b) has read its gradient back by then. A new
write still waits for the block's previous one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fuyou.device.base import Event
from fuyou.device.host_threads import serial_worker
from fuyou.models.store_layout import ModelLayout, elem_size
from fuyou.schedule.sizing import GRADS, park_class
from fuyou.storage.dirs import preallocate
from fuyou.storage.io_base import FileHandle, IOBackend
from fuyou.timeline import Timeline
from fuyou.transfer.gradients import Offloads
from fuyou.transfer.host_pool import HostBuffer, HostBufferPool
from fuyou.units import align_up

GRAD_DIR = "gradients"


class FutureEvent(Event):
    """An ``Event`` that completes with a future (an SSD read): ``wait`` raises the read's error."""

    def __init__(self, fut: Future) -> None:
        self.fut = fut

    def wait(self, stream: object | None = None) -> None:
        """Block until the read has landed (host-side data: no stream is involved)."""
        self.fut.result()

    def query(self) -> bool:
        """Whether the read has finished."""
        return self.fut.done()


@dataclass
class OnSSD:
    """A gradient parked on SSD: the block, and the write that puts it there."""

    block: int
    written: Future


Parked = tuple[HostBuffer, Event] | OnSSD
"""A parked gradient: a host buffer with its copy-done event (RAM), or ``OnSSD``."""


class GradientParking:
    """Parks finished gradients in RAM or on SSD and hands them to the Adam stage; see the module
    docstring. ``gradients`` copies them off the device (the Adam stage's ``offload``: its
    device-to-host stream); ``ssd_blocks``: the blocks whose gradients park on SSD."""

    def __init__(
        self,
        gradients: Offloads,
        pool: HostBufferPool,
        layout: ModelLayout,
        io: IOBackend,
        dirs: list[str],
        direct: list[bool],
        timeline: Timeline,
        ssd_blocks: list[int],
        checksums: bool = True,
    ) -> None:
        self.gradients, self.pool, self.layout, self.io, self.timeline = gradients, pool, layout, io, timeline
        self.checksums = checksums
        self.dirs = [os.path.join(d, GRAD_DIR) for d in dirs]
        self._direct = direct
        self._files: dict[int, FileHandle] = {}
        self._crcs: dict[int, list[int]] = {}
        self._last: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._writer = (
            ThreadPoolExecutor(1, thread_name_prefix="fuyou-grad-park", initializer=serial_worker)
            if ssd_blocks
            else None
        )
        for b in ssd_blocks:
            self._files[b] = self._open(b)

    def _nbytes(self, b: int) -> int:
        return self.layout.numel(b) * elem_size(self.layout.compute_dtype)

    def _open(self, b: int) -> FileHandle:
        i = b % len(self.dirs)
        os.makedirs(self.dirs[i], exist_ok=True)
        path = os.path.join(self.dirs[i], f"b{b}.grad")
        if os.path.exists(path):
            os.unlink(path)
        preallocate(path, align_up(max(self._nbytes(b), 1), 4096))
        return self.io.open(path, self._direct[i])

    def on_ssd(self, b: int) -> bool:
        """Whether block ``b``'s gradient parks on SSD."""
        return b in self._files

    # ------------------------------------------------------------------ park
    def park(self, b: int, grad: torch.Tensor, after: Event | None = None) -> Parked:
        """Park block ``b``'s finished device gradient ``grad`` (``after``: as for ``offload``); returns
        at once (the copy and any write run asynchronously)."""
        if not self.on_ssd(b):
            return self.gradients.offload(b, grad, park_class(b), after)
        buf, ready = self.gradients.offload(b, grad, GRADS, after)
        prev = self._last.get(b)
        assert self._writer is not None
        fut = self._writer.submit(self._write, b, buf, ready, prev, self.timeline.serving)
        self._last[b] = fut
        return OnSSD(b, fut)

    def _write(self, b: int, buf: HostBuffer, ready: Event, prev: Future | None, key: int | None) -> None:
        """Writer thread: once the device→host copy has landed (and the block's previous write), write
        (its bytes count for the timeline's step ``key``, the one that parked it)."""
        try:
            ready.wait()
            if prev is not None:
                prev.exception()
            n = self._nbytes(b)
            fut = self.io.write(self._files[b], buf.data[:n].numpy(), self.checksums)
            crcs = self.timeline.track(fut, "ssd_write", f"grad {self.layout.blocks[b].name}", n, key).result()
            with self._lock:
                self._crcs[b] = crcs
        finally:
            self.pool.release(buf)

    # ------------------------------------------------------------------ hand to Adam
    def source(
        self, parked: Parked
    ) -> tuple[HostBuffer | Callable[[int | None], tuple[HostBuffer, Event]], Event | None]:
        """What ``AdamStage.update`` takes for ``parked``: the buffer and its event, or (SSD) a callable
        the stage's feeder runs, with the key of the step the update serves, to read the gradient back,
        and no event."""
        if isinstance(parked, OnSSD):
            return (lambda key: self._read_back(parked, key)), None
        return parked

    def _read_back(self, parked: OnSSD, key: int | None) -> tuple[HostBuffer, Event]:
        """Feeder thread: take a ``grads`` buffer and start reading block's gradient into it (its bytes
        counted for step ``key``)."""
        parked.written.result()  # raises the write's error, if any
        b, n = parked.block, self._nbytes(parked.block)
        buf = self.pool.acquire(GRADS)
        try:
            with self._lock:
                crcs = self._crcs[b] if self.checksums else None
            fut = self.io.read(self._files[b], buf.data[:n].numpy(), crcs, f"parked gradient of block {b}")
        except BaseException:
            self.pool.release(buf)
            raise
        return buf, FutureEvent(self.timeline.track(fut, "ssd_read", f"grad {self.layout.blocks[b].name}", n, key))

    def discard(self, parked: Parked) -> None:
        """A skipped (non-finite) step: give back a RAM-parked buffer once its copy landed; an SSD write
        finishes by itself (its buffer returns when it lands)."""
        if isinstance(parked, OnSSD):
            parked.written.exception()
            return
        buf, ready = parked
        ready.wait()
        self.pool.release(buf)

    def close(self) -> None:
        """Wait for writes in flight, close and remove the scratch files."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        for h in self._files.values():
            self.io.close(h)
            if os.path.exists(h.path):
                os.unlink(h.path)
        self._files.clear()
