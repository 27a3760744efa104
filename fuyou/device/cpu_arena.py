"""A caching allocator for the CPU backend's "device" memory: freed blocks keep their pages.

On CPU the device is host RAM. glibc returns large blocks (above its 32 MiB mmap threshold at most)
to the OS on free, so each layer's weights and gradient buffer, allocated and freed once or twice per
step, would be first-touch page-faulted again every time: measured ~2 s of system time per step for
a 156 M-parameter fp32 model, the largest part of the engine's overhead over in-RAM PyTorch on CPU.
The arena does what CUDA's caching allocator does: a freed block stays mapped and serves the next
request of the same size.

Accounting is exact. Bytes of live storages are charged against the fake capacity (and raise
DeviceMemoryError past it); cached free blocks are not charged (CUDA's reserved-but-unallocated
memory). Cached free bytes are capped at ``CACHE_FACTOR`` × the peak of live bytes (a step cycles
through a few block sizes — embedding, layer, head — each needed again the next step); on the CPU
backend that memory stands for GPU memory, so it is outside the host budget, like the device's.
A storage is live while anything but the arena references it (its C++ use count), which covers
views, parameters and autograd's saved tensors.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict

import torch

from fuyou.device.base import device_full
from fuyou.errors import DeviceMemoryError

SUPPORTED = hasattr(torch._C, "_storage_Use_Count") and hasattr(torch.UntypedStorage, "_swap_data_ptr_")
"""Whether this torch build exposes what the arena needs (use counts, data-pointer swaps)."""


"""Cached free bytes are kept at most this multiple of the peak of live bytes."""

CACHE_FACTOR = 3
"""Cached free bytes are kept at most this multiple of the peak of live bytes."""


def _use_count(s: torch.UntypedStorage) -> int:
    return int(torch._C._storage_Use_Count(s._cdata))


class CachingArena:
    """Exact device-memory accounting with a same-size free-block cache (bytes throughout)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.allocated = 0
        self.peak = 0
        self._lent: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self._free: OrderedDict[int, torch.UntypedStorage] = OrderedDict()  # id → storage, oldest first
        self._free_bytes = 0
        self._foreign: dict[int, int] = {}
        """Storages torch allocated during compute (``adopt``): id → bytes charged."""
        self._foreign_refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- public
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int, what: str) -> torch.Tensor:
        """An uninitialised tensor of ``shape``/``dtype`` (``nbytes``); DeviceMemoryError past capacity.

        A cached block up to 1/16 larger may serve the request; the charge is the block's size.
        """
        with self._lock:
            self._sweep()
            s = self._block(nbytes, what)
            self._lent[id(s)] = (s, s.nbytes())
            self._trim()
        return torch.empty(0, dtype=dtype).set_(s, 0, shape)  # type: ignore[call-overload]  # torch's stubs lack set_(source, offset, size) (stride optional at runtime)

    def release(self, tensor: torch.Tensor) -> None:
        """Free the memory under ``tensor`` and its views (they keep their metadata, 0 bytes)."""
        with self._lock:
            s = tensor.untyped_storage()
            entry = self._lent.pop(id(s), None)
            if entry is not None:
                self.allocated -= entry[1]
            if s.nbytes():
                spare = torch.UntypedStorage(0)
                s._swap_data_ptr_(spare)  # type: ignore[attr-defined]  # private torch API, not in its stubs
                self._put(spare)
                self._trim()

    def restore(self, tensor: torch.Tensor, nbytes: int, what: str) -> torch.Tensor:
        """Give ``nbytes`` back under a released ``tensor``; return a flat uint8 alias to fill."""
        with self._lock:
            self._sweep()
            s = tensor.untyped_storage()
            entry = self._lent.pop(id(s), None)
            if entry is not None:
                self.allocated -= entry[1]
            try:
                donor = self._block(nbytes, what)
            except DeviceMemoryError:
                if entry is not None:
                    self._lent[id(s)] = entry
                    self.allocated += entry[1]
                raise
            s._swap_data_ptr_(donor)  # type: ignore[attr-defined]  # private torch API, not in its stubs
            if donor.nbytes():
                self._put(donor)
            self._lent[id(s)] = (s, s.nbytes())
            self._trim()
        return torch.empty(0, dtype=torch.uint8).set_(s, 0, (nbytes,))  # type: ignore[call-overload]  # torch's stubs lack set_(source, offset, size) (stride optional at runtime)

    def adopt(self, s: torch.UntypedStorage, what: object) -> None:
        """Charge ``s``, a storage torch allocated outside the arena (an op's output during compute:
        ``cpu_allocations``), until it is freed; DeviceMemoryError naming ``what`` (its ``str``) past the
        capacity (``s`` is then not charged). Idempotent; the arena's own storages are already charged."""
        with self._lock:
            key = id(s)
            if key in self._lent or key in self._foreign:
                return
            n = s.nbytes()
            self._charge(n, what)
            self._foreign[key] = n
            # a weak reference whose callback refunds (cheaper per op than weakref.finalize)
            self._foreign_refs[key] = weakref.ref(s, functools.partial(self._refund_dead, key))

    def _refund_dead(self, key: int, _: object) -> None:
        self._refund_foreign(key)

    def _refund_foreign(self, key: int) -> None:
        with self._lock:
            self.allocated -= self._foreign.pop(key, 0)
            self._foreign_refs.pop(key, None)

    def stats(self) -> tuple[int, int, int]:
        """(allocated, peak, cached free) bytes, after noticing storages freed since the last call."""
        with self._lock:
            self._sweep()
            return self.allocated, self.peak, self._free_bytes

    # ---------------------------------------------------------------- internals
    def _block(self, nbytes: int, what: str) -> torch.UntypedStorage:
        """A charged block of ≥ ``nbytes``: a cached one up to 1/16 larger, else a new one."""
        s = self._pop_fit(nbytes)
        if s is not None:
            try:
                self._charge(s.nbytes(), what)
                return s
            except DeviceMemoryError:
                self._put(s)
                if s.nbytes() == nbytes:
                    raise
        self._charge(nbytes, what)
        try:
            return torch.UntypedStorage(nbytes)
        except BaseException:
            self.allocated -= nbytes
            raise

    def _charge(self, nbytes: int, what: object) -> None:
        if self.allocated + nbytes > self.peak:  # a new peak or past capacity: count what was freed first, as
            self._sweep()  # CUDA's allocator would have (arena blocks are refunded lazily, by ``_sweep``)
        if self.allocated + nbytes > self.capacity:
            raise device_full(nbytes, self.allocated, self.capacity, what)
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def _sweep(self) -> None:
        """Move storages nobody else references any more from lent to free, refunding them."""
        for key, (s, n) in list(self._lent.items()):
            if _use_count(s) == 1:
                del self._lent[key]
                self.allocated -= n
                if s.nbytes():
                    self._put(s)
        self._trim()

    def _pop_fit(self, nbytes: int) -> torch.UntypedStorage | None:
        """The smallest cached free storage of ``nbytes`` … ``nbytes + nbytes/16``, removed from the cache."""
        best = None
        for key, s in self._free.items():
            if nbytes <= s.nbytes() <= nbytes + nbytes // 16 and (best is None or s.nbytes() < best[1].nbytes()):
                best = (key, s)
        if best is None:
            return None
        del self._free[best[0]]
        self._free_bytes -= best[1].nbytes()
        return best[1]

    def _put(self, s: torch.UntypedStorage) -> None:
        self._free[id(s)] = s
        self._free_bytes += s.nbytes()

    def _trim(self) -> None:
        """Drop the oldest free blocks until the cached bytes ≤ ``CACHE_FACTOR`` × the peak of live bytes."""
        while self._free and self._free_bytes > CACHE_FACTOR * self.peak:
            _, s = self._free.popitem(last=False)
            self._free_bytes -= s.nbytes()
