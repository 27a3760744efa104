"""Activations on SSD: saved tensors of one (block, micro-batch) packed into one file, read back ahead.

Forward: the saved-tensor pack hook starts copying each tensor to host memory (pinned staging on
CUDA) on the device-to-host stream (``activation_copies``); when the block is done, ``flush`` chains,
after the last of those copies, packing them into one page-aligned buffer (host-only, pageable) and
writing it (one large, checksummed I/O through the store's I/O backend) to a scratch file reused
across steps: the training thread waits for neither. Backward: ``prefetch`` reads the file back,
issued a block early, into page-aligned staging (``Backend.host_staging_aligned``: pinned on CUDA; or,
where the write had not landed yet, into the host copy it writes from, once it has: every record is read
back once, whatever the timing);
``upload``, a micro-batch ahead, reserves the tensors' device memory and starts the copies back on
the host-to-device stream if that read has landed (else the unpack hook does, after it), and the
unpack hook hands compute the device tensors, which wait only for their copies' events. Host bytes are charged to the host budget
while they exist.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from fuyou.device.base import Backend, Event, host_aligned_empty
from fuyou.storage.dirs import preallocate
from fuyou.storage.io_base import FileHandle, IOBackend
from fuyou.timeline import Timeline
from fuyou.transfer.activation_copies import ActivationCopies, HostCopy
from fuyou.transfer.futures import chain, done_future, event_future
from fuyou.transfer.host_pool import HostBufferPool
from fuyou.units import TENSOR_ALIGN, align_up


class ActivationSpace:
    """Scratch files for swapped activations, striped over the store directories."""

    def __init__(
        self,
        backend: Backend,
        pool: HostBufferPool,
        io: IOBackend,
        dirs: list[str],
        direct: list[bool],
        timeline: Timeline,
    ) -> None:
        self.backend, self.pool, self.io, self.timeline = backend, pool, io, timeline
        self.copies = ActivationCopies(backend, timeline)
        """Device ↔ host copies of swapped tensors, on their own streams."""
        self.dirs = [os.path.join(d, "activations") for d in dirs]
        self.direct = direct
        self._files: dict[tuple[int, int], tuple[FileHandle, int]] = {}
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)

    def handle(self, b: int, k: int, nbytes: int) -> FileHandle:
        """The scratch file of (block, micro-batch), (re)allocated to hold ``nbytes``."""
        cur = self._files.get((b, k))
        if cur is not None and cur[1] >= nbytes:
            return cur[0]
        i = b % len(self.dirs)
        path = os.path.join(self.dirs[i], f"b{b}.k{k}.act")
        if cur is not None:
            self.io.close(cur[0])
        if os.path.exists(path):
            os.unlink(path)
        preallocate(path, align_up(max(nbytes, 1), 4096))
        h = self.io.open(path, self.direct[i])
        self._files[(b, k)] = (h, nbytes)
        return h

    def close(self) -> None:
        """Close and remove the scratch files."""
        for h, _ in self._files.values():
            self.io.close(h)
            os.unlink(h.path)
        self._files.clear()


@dataclass
class SSDRecord:
    """The saved tensors of one (block, micro-batch) on their way to and from the SSD."""

    space: ActivationSpace
    block: int
    micro: int
    metas: list[tuple[torch.device, torch.Size, torch.dtype, int, int]] = field(default_factory=list)
    pending: list[torch.Tensor] = field(default_factory=list)
    landed: Event | None = None
    """The event after the last copy off the device into ``pending``."""
    staging: torch.Tensor | None = None
    packed: Future | None = None
    """``staging`` filled from ``pending`` (after their copies landed)."""
    io: Future | None = None
    """The read back from SSD, if one was needed."""
    wfut: Future | None = None
    """The write to SSD."""
    crcs: list[int] | None = None
    back: list[HostCopy] | None = None
    """The tensors' device memory, reserved by ``upload``; their copies start once staging holds the data."""
    started: bool = False
    """The copies back have been issued."""
    charged: int = 0
    wanted: bool = False
    """Backward has claimed the record: a completing write must not free the host copy."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _charge(self, n: int) -> None:
        self.space.pool.charge(n, f"activations of block {self.block}")
        self.charged += n

    def pack(self, t: torch.Tensor) -> int:
        """Copy ``t`` to host memory; return its index for ``unpack``."""
        n = t.numel() * t.element_size()
        off = align_up(self.metas[-1][3] + self.metas[-1][4], TENSOR_ALIGN) if self.metas else 0
        self._charge(n)
        self.metas.append((t.device, t.shape, t.dtype, off, n))
        c = self.space.copies.off(t.detach(), f"act b{self.block} k{self.micro}")
        self.pending.append(c.host)
        self.landed = c.landed
        return len(self.metas) - 1

    @property
    def nbytes(self) -> int:
        """Packed size in bytes."""
        return align_up(self.metas[-1][3] + self.metas[-1][4], TENSOR_ALIGN) if self.metas else 0

    def flush(self) -> None:
        """Pack the host copies into one buffer and start writing it; memory is returned when written."""
        if not self.metas:
            return
        n = self.nbytes
        self._charge(n)
        self.staging = staging = host_aligned_empty(n)
        pieces, self.pending = self.pending, []
        h = self.space.handle(self.block, self.micro, n)
        assert self.landed is not None  # set by every pack()
        self.packed = chain(event_future(self.landed, "activations"), lambda: self._pack(staging, pieces))
        fut = chain(self.packed, lambda: self.space.io.write(h, staging.numpy()))
        self.wfut = self.space.timeline.track(fut, "ssd_write", f"act b{self.block} k{self.micro}", n)
        self.wfut.add_done_callback(self._written)

    def _pack(self, staging: torch.Tensor, pieces: list[torch.Tensor]) -> Future:
        """Copy the host copies (landed) into ``staging`` and return their bytes to the budget."""
        for (_, _, _, off, size), t in zip(self.metas, pieces):
            staging[off : off + size].copy_(t.reshape(-1).view(torch.uint8))
        n = sum(t.numel() * t.element_size() for t in pieces)
        pieces.clear()
        with self.lock:
            self.space.pool.refund(n)
            self.charged -= n
        return done_future()

    def _written(self, f: Future) -> None:
        """Write landed: free the host copy, unless backward already claimed it (``wanted``)."""
        with self.lock:
            if f.exception() is None:
                self.crcs = f.result()
                if not self.wanted:
                    self.staging = None
                    self.space.pool.refund(self.charged)
                    self.charged = 0

    def prefetch(self) -> None:
        """Start reading the record back for backward: into new staging if its write has freed the host
        copy, else (the write still in flight when backward asks) into the host copy itself once the
        write has landed. Either way the same bytes are read, whatever the write's timing, as the
        planner counts them (the second case re-reads what memory holds: the price of a byte count that
        does not depend on timing; it also checks the written record's checksums). Idempotent."""
        with self.lock:
            if not self.metas or self.wanted:
                return
            self.wanted = True  # a write landing from now on keeps the host copy
            kept = self.staging
        assert self.wfut is not None  # flush() started the write before backward asks
        n = self.nbytes
        if kept is not None:
            fut = chain(self.wfut, lambda: self._read(kept))
        else:
            self.wfut.result()  # raises the write's error, if any
            self._charge(n)
            self.staging = self.space.backend.host_staging_aligned(n)
            fut = self._read(self.staging)
        self.io = self.space.timeline.track(fut, "ssd_read", f"act b{self.block} k{self.micro}", n)

    def _read(self, staging: torch.Tensor) -> Future:
        """Read the record's file into ``staging`` (after its write: ``crcs`` set)."""
        h = self.space.handle(self.block, self.micro, self.nbytes)
        return self.space.io.read(h, staging.numpy(), self.crcs, f"activations of block {self.block}")

    def upload(self, wait: bool = False) -> None:
        """Reserve the tensors' device memory and start their copies back if staging holds the data
        (packed in memory, or read back from SSD): at once if it does, else — ``wait`` — once it does.
        Idempotent."""
        self.prefetch()
        if not self.metas or self.started:
            return
        what = f"activations of block {self.block}"
        if self.back is None:  # the device memory is taken here whatever the read's timing
            staging = self.staging
            assert staging is not None  # prefetch() kept it or is reading it back into it
            self.back = [
                self.space.copies.reserve(staging[off : off + size].view(dtype).view(shape), what)
                for _, shape, dtype, off, size in self.metas
            ]
        filled = [f for f in (self.packed, self.io) if f is not None]
        if not wait and not all(f.done() for f in filled):
            return  # the read is still in flight: unpack issues the copies (the training thread never waits here)
        with self.space.timeline.gap(self.space.copies.compute):  # compute idles while the host waits
            for f in filled:  # hazard: copying staging before it was filled
                f.result()
        for c in self.back:
            self.space.copies.upload(c, what)
        self.started = True

    def unpack(self, i: int) -> torch.Tensor:
        """Tensor ``i`` back on its device, for compute (waits for the read if ``upload`` found it still
        in flight, then issues the copies)."""
        self.upload(wait=True)
        assert self.back is not None  # upload() started them: the record has tensors
        return self.space.copies.take(self.back[i], f"activations of block {self.block}")

    def release(self) -> None:
        """After backward: drop the host copy and return its bytes to the budget.

        Waits for the record's write, so the next step never writes the same file concurrently.
        """
        for f in (self.wfut, self.io):
            if f is not None:
                f.exception()
        with self.lock:
            self.staging = None  # copies still in flight hold their views of it (``HostCopy.host``)
            self.back, self.started = None, False
            self.space.pool.refund(self.charged)
            self.charged = 0
