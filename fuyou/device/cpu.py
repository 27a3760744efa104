"""The CPU backend: the "device" is the CPU, streams are null and events are already complete.

It enforces a configurable fake device capacity so budget logic is exercised without a GPU, and
caches freed device blocks (``cpu_arena.py``) so layers streamed every step do not re-fault pages;
torch's own temporaries stay cached in the C library's heap (``cpu_malloc.py``).
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from fuyou.device import cpu_arena, cpu_malloc
from fuyou.device.base import Backend, Event, MemoryStats, _DeviceAccounting, host_aligned_empty
from fuyou.device.cpu_allocations import Allocations, paused


class CompletedEvent(Event):
    """An event whose work is always done: CPU ops run synchronously on the issuing thread."""

    def __init__(self) -> None:
        self._t = time.perf_counter()

    def when(self) -> float:
        """When the event was recorded (its work was done then)."""
        return self._t

    def wait(self, stream: Any | None = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always complete."""
        return True


class CPUBackend(Backend):
    """Device = CPU, with a fake capacity (bytes) for device allocations."""

    name = "cpu"

    def __init__(self, capacity: int = 2**62) -> None:
        self.device = torch.device("cpu")
        cpu_malloc.keep_freed_memory()
        self._arena = cpu_arena.CachingArena(capacity) if cpu_arena.SUPPORTED else None
        self._acct = _DeviceAccounting(capacity)  # used only where torch lacks what the arena needs

    def host_empty(self, nbytes: int, pinned: bool = True) -> torch.Tensor:
        """A page-aligned uint8 host tensor of exactly ``nbytes``; ``pinned`` changes nothing (no GPU)."""
        with paused():
            return host_aligned_empty(nbytes)

    def host_staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for a transient copy (host memory, not counted as the device's)."""
        with paused():
            return torch.empty(shape, dtype=dtype)

    def host_staging_aligned(self, nbytes: int) -> torch.Tensor:
        """Page-aligned host staging (host memory, not counted as the device's)."""
        with paused():
            return host_aligned_empty(nbytes)

    def counting(self, what: str) -> AbstractContextManager[Any]:
        """Count every storage torch allocates on this thread inside against the fake capacity, as a
        GPU's allocator would (``cpu_allocations.Allocations``); DeviceMemoryError naming ``what``
        past it."""
        return Allocations(self._adopt, what)

    def _adopt(self, storage: torch.UntypedStorage, what: object) -> None:
        (self._arena if self._arena is not None else self._acct).adopt(storage, what)

    def device_empty(
        self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "a tensor", stream: Any | None = None
    ) -> torch.Tensor:
        """A CPU tensor counted against the fake capacity (``stream``: unused, CPU work is synchronous);
        raises DeviceMemoryError past it."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self._arena is not None:
            return self._arena.empty(tuple(shape), dtype, nbytes, what)
        self._acct.charge(nbytes, what)
        try:
            with paused():  # charged here, not again by the allocation meter
                t = torch.empty(shape, dtype=dtype)
        except BaseException:
            self._acct.refund(nbytes)
            raise
        self._acct.track(t, nbytes)
        return t

    def free_storage(self, tensor: torch.Tensor) -> None:
        """Release the memory under ``tensor`` and its views (kept in the arena's cache)."""
        if self._arena is None:
            super().free_storage(tensor)
        else:
            self._arena.release(tensor)

    def restore_storage(
        self, tensor: torch.Tensor, nbytes: int, what: str = "a tensor", stream: Any | None = None
    ) -> torch.Tensor:
        """Re-allocate ``nbytes`` under a freed tensor (from the cache if it can; ``stream`` unused);
        DeviceMemoryError past capacity."""
        if self._arena is None:
            return super().restore_storage(tensor, nbytes, what)
        return self._arena.restore(tensor, nbytes, what)

    def _account_resize(self, tensor: torch.Tensor, nbytes: int, what: str) -> None:
        """Keep the fake capacity exact across free/restore of a storage (no-arena fallback)."""
        self._acct.resize(tensor, nbytes, what)

    def new_stream(self) -> Any:
        """CPU work is synchronous: the null stream."""
        return None

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """No-op context."""
        return nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any | None = None) -> Event:
        """Copy now, on the calling thread; the event is already complete."""
        dst.copy_(src)
        return CompletedEvent()

    def record(self, stream: Any | None = None) -> Event:
        """An already-completed event."""
        return CompletedEvent()

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Nothing is asynchronous on CPU."""

    def synchronize(self) -> None:
        """Nothing is queued on CPU."""

    def memory(self) -> MemoryStats:
        """Bytes of live device tensors, their peak, the fake capacity, and what is reserved: live
        plus the arena's cached free blocks (without the arena, just the live bytes)."""
        if self._arena is not None:
            allocated, peak, cached = self._arena.stats()
            return MemoryStats(
                allocated=allocated, peak=peak, capacity=self._arena.capacity, reserved=allocated + cached
            )
        a = self._acct
        return MemoryStats(allocated=a.allocated, peak=a.peak, capacity=a.capacity, reserved=a.allocated)
