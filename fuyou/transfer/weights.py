"""Streaming compute weights SSD → host buffer → device, block by block, ``depth`` blocks ahead.

Reads go through the ``RamTier`` facade: RAM-tier blocks' weights are a memcpy instead of an SSD read.
A block whose update is in flight is *claimed* at its first read of a step from the Adam stage's new-weights
buffer (``fuyou.transfer.new_weights``: a memcpy once Adam's kernels are done, without waiting for its SSD
write and reading it back; the clipping schedule holds that buffer until this claim). Its later reads of the
step (the head's tied embedding, backward) go to the store once that write has landed, whether or not the
buffer happens to be held still: what a step reads from the SSD does not depend on timing, and the planner
counts the same bytes (``fuyou.planner.graph``: a handoff at a block's first position in the load order).

The loader walks one step's load order — forward 0…H, then backward H−1…0, with a tied
embedding loaded again for the head — issuing reads ahead into a fixed set of host buffers. A
read can be *gated*: in the clipping schedule, block b's read starts only once Adam has written
block b's new weights (the gate future), without blocking the training thread.

Uploads overlap compute. Device weight buffers are handed out for the copy stream (the FSDP pattern:
on CUDA, from that stream's pool of the caching allocator) and marked as used by the compute stream
(``keep_alive``, CUDA's ``record_stream``), so an upload never waits for compute to finish with
recycled memory: the allocator reuses a block only after the compute queued before its release.
When every host buffer is busy, the next read goes into the buffer of the oldest upload still in
flight, started by a waiter thread once that upload has landed (``futures.event_future``): the
training thread only ever waits for the read of the block it needs now.

With data-parallel ranks (``comm``) the read and upload move this rank's shard; ``next`` then has
the ranks gather the whole block on their collectives' stream (``Collectives.gather``) into the
buffer it returns, and ``ready_event`` marks that gather.

A block with parameters frozen by ``--freeze`` has a second, read-only extent (``ModelLayout.f``): it is
read beside ``w/<block>`` into the same host buffer and uploaded behind the trained part, never gated
or claimed (nothing rewrites it).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

import torch

from fuyou.device.base import Backend, Event
from fuyou.models.store_layout import ModelLayout, elem_size
from fuyou.schedule.sizing import WEIGHTS as HOST_CLASS
from fuyou.storage.io_base import gather, then
from fuyou.timeline import Timeline
from fuyou.transfer.collectives import Collectives
from fuyou.transfer.futures import chain, done_future, event_future
from fuyou.transfer.host_pool import HostBuffer, HostBufferPool
from fuyou.transfer.new_weights import NewWeights
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
        compute_stream: object,
        comm: Collectives,
        new_weights: NewWeights | None = None,
        gate: Callable[[int], Future] | None = None,
    ) -> None:
        """``comm``: the ranks' collectives (with several, the upload is a shard that ``next`` gathers);
        ``new_weights``: where a block whose update is in flight is claimed from (the Adam stage's; None:
        never); ``gate``: the future a read of block b waits for (the update policy's; None: none)."""
        self.store, self.backend, self.pool, self.layout = store, backend, pool, layout
        self.timeline, self.depth, self.stream, self.compute = timeline, depth, copy_stream, compute_stream
        self.comm, self.new_weights = comm, new_weights
        self.gate: Callable[[int], Future] = gate or (lambda b: done_future())
        self.sharded = comm.world > 1
        """Whether blocks arrive as this rank's shard, gathered from the ranks (else uploaded whole)."""
        self.order: list[int] = []
        self._first: dict[int, int] = {}
        self.pos = 0
        self._reads: dict[int, tuple[HostBuffer, Future]] = {}
        self._copies: list[tuple[HostBuffer, Event]] = []

    def start(self, order: list[int]) -> None:
        """Begin a new load order (one step); reads for its first ``depth`` blocks are issued."""
        if self._reads:
            raise RuntimeError("previous load order not finished")
        self.order, self.pos = order, 0
        self._first = {b: len(order) - 1 - i for i, b in enumerate(reversed(order))}
        """Each block's first position in the order: the read that may claim its new weights."""
        self._issue()

    def _issue(self) -> None:
        for p in range(self.pos, min(self.pos + self.depth + 1, len(self.order))):
            if p not in self._reads:
                b = self.order[p]
                buf, free = self._buffer()
                first = self._first[b] == p
                key = self.timeline.serving  # the read may start on another thread, once ``free``
                self._reads[p] = (buf, chain(free, partial(self._read, b, buf, first, key)))

    def _read(self, b: int, buf: HostBuffer, first: bool, key: int | None) -> Future:
        """Fill ``buf`` with block ``b``'s latest weights (``Footprint.staged_bytes``): the trained
        part (``_read_trained``; ``first``: the block's first read of the load order), and its read-only
        part if it has one; the bytes count for the timeline's step ``key``."""
        trained = self._read_trained(b, buf, first, key)
        f = self.layout.f(b)
        if f is None:
            return trained
        at = self.layout.frozen_offset(b)
        frozen = self.store.read(f.name, buf.data[at : at + f.nbytes])
        if not self.store.holds(f.name):
            frozen = self.timeline.track(frozen, "ssd_read", f.name, f.nbytes, key)
        return then(gather([trained, frozen]), lambda _: None)

    def _read_trained(self, b: int, buf: HostBuffer, first: bool, key: int | None) -> Future:
        """Fill ``buf`` with block ``b``'s latest trained weights: at its ``first`` read of the step claimed
        from an update in flight, else read from the store (RAM tier or SSD) once the gate allows."""
        ext = self.layout.w(b)
        if self.store.holds(ext.name):  # RAM tier: a memcpy that times itself
            return chain(self.gate(b), partial(self.store.read, ext.name, buf.data))
        claimed = self.new_weights.claim(b, buf.data) if first and self.new_weights is not None else None
        if claimed is not None:
            return claimed

        def read() -> Future:
            return self.timeline.track(self.store.read(ext.name, buf.data), "ssd_read", ext.name, ext.nbytes, key)

        return chain(self.gate(b), read)

    def _buffer(self) -> tuple[HostBuffer, Future]:
        """A host buffer for the next read, and a future for when it may be written: a free buffer at
        once, else the buffer of the oldest upload in flight, once that upload has landed."""
        self._reap(wait=False)
        if self.pool.available(HOST_CLASS) or not self._copies:
            return self.pool.acquire(HOST_CLASS), done_future()
        buf, ev = self._copies.pop(0)
        landed = event_future(ev, "weights")  # the read may refill buf only once the upload out of it has run
        return buf, landed

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
        lay = self.layout
        n, f = lay.w(b).nbytes, lay.f(b)
        fn, at = (f.nbytes, lay.frozen_offset(b)) if f is not None else (0, 0)
        size = elem_size(lay.compute_dtype)
        what = f"weights of {lay.blocks[b].name}"
        full, trained = lay.device_numel(b) * size, lay.full_numel(b) * size
        if into is None:
            into = whole = self.backend.device_empty((full,), torch.uint8, what, stream=self.comm_or_copy())
        else:
            whole = self.backend.restore_storage(into, full, what, stream=self.comm_or_copy())
        # hazard: the copy stream's allocator pool must not refill this memory while compute reads it
        self.backend.keep_alive(into, self.compute)
        shard: torch.Tensor | None = None
        if self.sharded:  # upload the shard into memory of its own, gather into the block's
            shard = self.backend.device_empty((n + fn,), torch.uint8, what, stream=self.stream)
        dst_w, dst_f = (shard[:n], shard[n:]) if shard is not None else (whole[:n], whole[trained : trained + fn])
        with self.timeline.device_span("h2d", lay.blocks[b].name, self.backend, self.stream, n + fn):
            copied = self.backend.copy(dst_w, buf.data[:n], self.stream)
            if fn:
                copied = self.backend.copy(dst_f, buf.data[at : at + fn], self.stream)
        self._copies.append((buf, copied))
        if shard is not None:
            self.comm.gather(shard[:n], whole[:trained], copied, lay.blocks[b].name)
            if fn:
                self.comm.gather(shard[n:], whole[trained:], copied, f"{lay.blocks[b].name} (frozen)")
        self._reap(wait=False)
        self._issue()
        return into

    def comm_or_copy(self) -> object:
        """The stream that fills the buffer ``next`` returns: the collectives' (ranks), else the copy stream."""
        return self.comm.stream if self.sharded else self.stream

    def ready_event(self) -> Event:
        """Event after the latest copy (or gather); the compute stream waits on it before using the weights."""
        return self.backend.record(self.comm_or_copy())

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
