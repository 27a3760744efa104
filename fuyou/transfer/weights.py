"""Streaming compute weights SSD → host buffer → device, block by block, ``depth`` blocks ahead.

Reads go through the ``RamTier`` facade: RAM-tier blocks' weights are a memcpy instead of an SSD read.

The loader walks one step's load order — forward 0…H, then backward H−1…0, with a tied
embedding loaded again for the head — issuing reads ahead into a fixed set of host buffers. A
read can be *gated*: in the clipping schedule, block b's read starts only once Adam has written
block b's new weights (the gate future), without blocking the training thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

import torch

from fuyou.device.base import Backend, Event
from fuyou.models.store_layout import ModelLayout
from fuyou.schedule.sizing import WEIGHTS as HOST_CLASS
from fuyou.timeline import Timeline
from fuyou.transfer.futures import chain, done_future
from fuyou.transfer.host_pool import HostBuffer, HostBufferPool
from fuyou.transfer.ram_tier import RamTier


class WeightLoader:
    """Prefetching reader of ``w/<block>`` extents; see the module docstring."""

    def __init__(
        self,
        store: RamTier,
        backend: Backend,
        pool: HostBufferPool,
        layout: ModelLayout,
        timeline: Timeline,
        depth: int,
        copy_stream: object,
    ) -> None:
        self.store, self.backend, self.pool, self.layout = store, backend, pool, layout
        self.timeline, self.depth, self.stream = timeline, depth, copy_stream
        self.order: list[int] = []
        self.pos = 0
        self._reads: dict[int, tuple[HostBuffer, Future]] = {}
        self._copies: list[tuple[HostBuffer, Event]] = []
        self.gate: Callable[[int], Future] = lambda b: done_future()

    def start(self, order: list[int]) -> None:
        """Begin a new load order (one step); reads for its first ``depth`` blocks are issued."""
        if self._reads:
            raise RuntimeError("previous load order not finished")
        self.order, self.pos = order, 0
        self._issue()

    def _issue(self) -> None:
        for p in range(self.pos, min(self.pos + self.depth + 1, len(self.order))):
            if p not in self._reads:
                self._reap(wait=self.pool.available(HOST_CLASS) == 0)
                b = self.order[p]
                buf = self.pool.acquire(HOST_CLASS)
                ext = self.layout.w(b)
                fut = chain(self.gate(b), partial(self.store.read, ext.name, buf.data))
                if not self.store.holds(ext.name):  # RAM-tier reads time themselves, as memcpys
                    fut = self.timeline.track(fut, "ssd_read", ext.name, ext.nbytes)
                self._reads[p] = (buf, fut)

    def _reap(self, wait: bool) -> None:
        """Release host buffers whose device copies are done (waiting for the oldest if ``wait``)."""
        keep = []
        for i, (buf, ev) in enumerate(self._copies):
            if ev.query() or (wait and i == 0):
                ev.wait()
                self.pool.release(buf)
            else:
                keep.append((buf, ev))
        self._copies = keep

    def next(self, b: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Block ``b``'s weights on the device as a flat uint8 tensor (the next entry of the order).

        With ``into`` (a tensor whose storage was freed after forward), its storage is restored and
        refilled, so parameters and autograd's saved views of them see the weights again.
        """
        if self.pos >= len(self.order) or self.order[self.pos] != b:
            raise RuntimeError(f"load order expected block {self.order[self.pos : self.pos + 1]}, got {b}")
        self._issue()
        buf, fut = self._reads.pop(self.pos)
        self.pos += 1
        fut.result()
        n = self.layout.w(b).nbytes
        what = f"weights of {self.layout.blocks[b].name}"
        if into is None:
            into = self.backend.device_empty((n,), torch.uint8, what)
            alias = into
        else:
            alias = self.backend.restore_storage(into, n, what)
        # hazard: a restored/new device buffer may still be in use by compute queued before it was freed
        self.backend.record().wait(self.stream)
        with self.timeline.span("h2d", self.layout.blocks[b].name, n):
            copied = self.backend.copy(alias, buf.data[:n], self.stream)
        self._copies.append((buf, copied))
        self._reap(wait=False)
        self._issue()
        return into

    def ready_event(self) -> Event:
        """Event after the latest copy; the compute stream waits on it before using the weights."""
        return self.backend.record(self.stream)

    def drain(self) -> None:
        """Wait for every read and copy and return all host buffers (end of a step, or on error)."""
        for buf, fut in self._reads.values():
            fut.exception()
            self.pool.release(buf)
        self._reads.clear()
        self._reap(wait=True)
        while self._copies:
            self._reap(wait=True)
        self.order, self.pos = [], 0
