"""The CUDA backend: the only module in Fuyou that touches ``torch.cuda``.

Host buffers are page-aligned anonymous mmaps, registered with ``cudaHostRegister`` when they cross
PCIe (``host_empty(pinned=True)``) — pinned at their exact size (torch's pinned caching allocator
rounds to powers of two) and 4 KiB aligned so the same buffer serves O_DIRECT/kvikio reads and async
H2D copies.

``capacity`` (``--gpu-memory``) is a real cap: it becomes torch's per-process memory fraction, so
everything the caching allocator reserves — Fuyou's buffers, activations, logits, cuBLAS workspaces,
cached free blocks — stays within it (past it torch frees its cached blocks, then raises
``torch.OutOfMemoryError``, which the engine turns into a one-line DeviceMemoryError). The CUDA
context itself lies outside the allocator and so outside the cap.

Events are created with ``blocking=True``: any event may be waited on by the host (a copy's event
before its host buffer is reused, a gradient's before the CPU Adam reads it), and a blocking event
puts the waiting thread to sleep instead of spinning a core the CPU Adam wants; a device-side wait
(``stream.wait_event``) does not depend on the flag.
"""

from __future__ import annotations

import math
import time
import weakref
from contextlib import AbstractContextManager
from typing import Any

import torch

from fuyou.device.base import Backend, Event, MemoryStats, device_full, host_aligned_empty
from fuyou.errors import FuyouError
from fuyou.units import HOST_ALIGN, format_size


def cuda_available() -> bool:
    """True if torch sees a CUDA device."""
    return torch.cuda.is_available()


class DeviceClock:
    """Converts CUDA event times to the host's ``time.perf_counter`` clock.

    An anchor event is recorded on the current stream and waited for (the host time then is the
    anchor's time, to within the wake-up latency, microseconds); an event's host time is the anchor's
    plus ``anchor.elapsed_time(event)``. The anchor is renewed when older than ``max_age_s`` (clock
    drift), which waits for the current stream: call ``when`` at step end, as the timeline does.
    """

    def __init__(self, device: torch.device, max_age_s: float = 10.0) -> None:
        self.device, self.max_age_s = device, max_age_s
        self._anchor: tuple[torch.cuda.Event, float] | None = None

    def to_host(self, ev: torch.cuda.Event) -> float:
        """``perf_counter`` seconds at which the device reached the completed timing event ``ev``."""
        if self._anchor is None or time.perf_counter() - self._anchor[1] > self.max_age_s:
            a = torch.cuda.Event(enable_timing=True, blocking=True)
            a.record(torch.cuda.current_stream(self.device))
            a.synchronize()
            self._anchor = (a, time.perf_counter())
        anchor, t = self._anchor
        return t + anchor.elapsed_time(ev) / 1000.0


class CUDAEvent(Event):
    """A recorded ``torch.cuda.Event``, blocking (a host wait sleeps rather than spins: module
    docstring); with a ``clock``, also timed (``when``)."""

    def __init__(self, stream: torch.cuda.Stream | None, clock: DeviceClock | None = None) -> None:
        self._ev = torch.cuda.Event(blocking=True, enable_timing=clock is not None)
        self._ev.record(stream)
        self._clock = clock

    def when(self) -> float | None:
        """When the device reached this event (``perf_counter`` seconds); None until then or untimed."""
        if self._clock is None or not self._ev.query():
            return None
        return self._clock.to_host(self._ev)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` after this event, or block the host (sleeping) when ``stream`` is None."""
        if stream is None:
            self._ev.synchronize()
        else:
            stream.wait_event(self._ev)

    def query(self) -> bool:
        """True once the recorded work has completed."""
        return self._ev.query()


class CUDABackend(Backend):
    """One CUDA device; ``capacity`` (bytes, default the whole device) caps what torch's caching
    allocator may reserve in this process (its per-process memory fraction: module docstring)."""

    name = "cuda"

    def __init__(self, capacity: int | None = None, index: int = 0) -> None:
        """Raises FuyouError if no CUDA device is visible."""
        if not torch.cuda.is_available():
            raise FuyouError("no CUDA device is visible; use --device cpu or check the driver (nvidia-smi)")
        self.device = torch.device("cuda", index)
        torch.cuda.set_device(self.device)  # torch's current stream and allocations default to this GPU (a rank's)
        total = torch.cuda.get_device_properties(self.device).total_memory
        self.capacity = total if capacity is None else min(capacity, total)
        self._cudart = torch.cuda.cudart()
        self._clock = DeviceClock(self.device)
        self._cap_allocator()

    def _cap_allocator(self) -> None:
        """Set torch's per-process memory fraction to ``capacity`` ÷ the device's memory (as the
        allocator measures it), so the allocator never reserves more than ``capacity``. Always set,
        1.0 for the whole device: the fraction is per process, and a backend must undo an earlier
        one's smaller cap."""
        total = torch.cuda.mem_get_info(self.device)[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, self.capacity / total), self.device)

    def describe(self) -> str:
        """The GPU's name, memory and CUDA version."""
        p = torch.cuda.get_device_properties(self.device)
        return f"{p.name}, {format_size(p.total_memory)}, CUDA {torch.version.cuda}"

    def host_empty(self, nbytes: int, pinned: bool = True) -> torch.Tensor:
        """A page-aligned uint8 host tensor of exactly ``nbytes``, pinned with cudaHostRegister if
        ``pinned`` (it crosses PCIe), else pageable.

        Raises FuyouError if registration fails (typically ``ulimit -l`` too low).
        """
        t = host_aligned_empty(nbytes)
        if pinned:
            self._register(t)
        return t

    def _register(self, t: torch.Tensor) -> None:
        """Page-lock ``t``'s whole storage until it is freed; FuyouError if the driver refuses."""
        ptr, size = t.data_ptr(), t.untyped_storage().nbytes()
        err = self._cudart.cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            raise FuyouError(
                f"cannot pin {format_size(size)} of host memory (cudaHostRegister error {int(err)}); "
                "raise the locked-memory limit (ulimit -l unlimited) or lower --cpu-memory"
            )
        weakref.finalize(t.untyped_storage(), self._cudart.cudaHostUnregister, ptr)

    def device_empty(
        self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "a tensor", stream: Any | None = None
    ) -> torch.Tensor:
        """A CUDA tensor from ``stream``'s pool of the caching allocator (None: the current stream);
        raises DeviceMemoryError naming ``what`` past the capacity."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        used = torch.cuda.memory_allocated(self.device)
        if used + nbytes > self.capacity:
            raise device_full(nbytes, used, self.capacity, what)
        with torch.cuda.stream(stream if stream is not None else self.current_stream()):
            return torch.empty(shape, dtype=dtype, device=self.device)

    def restore_storage(
        self, tensor: torch.Tensor, nbytes: int, what: str = "a tensor", stream: Any | None = None
    ) -> torch.Tensor:
        """``Backend.restore_storage``, the memory taken from ``stream``'s pool (None: the current stream)."""
        with torch.cuda.stream(stream if stream is not None else self.current_stream()):
            return super().restore_storage(tensor, nbytes, what)

    def _account_resize(self, tensor: torch.Tensor, nbytes: int, what: str) -> None:
        """Refuse a restore that would pass the capacity (the allocator counts the rest)."""
        used = torch.cuda.memory_allocated(self.device)
        if nbytes and used + nbytes > self.capacity:
            raise device_full(nbytes, used, self.capacity, what, verb="restoring")

    def host_staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pinned host tensor from torch's caching host allocator (it keeps the block until the
        copies recorded on it have run, so freeing it early is safe)."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def host_staging_aligned(self, nbytes: int) -> torch.Tensor:
        """Pinned, page-aligned staging of ``nbytes`` from torch's caching host allocator (which keeps
        a block until the copies recorded on it have run): its block as it is when page-aligned (large
        blocks are whole ``cudaHostAlloc`` allocations), else a page-aligned view of a block one page
        larger (torch may hand out small pinned blocks at any 512-byte boundary)."""
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        if t.data_ptr() % HOST_ALIGN == 0:
            return t[:nbytes]
        t = torch.empty(nbytes + HOST_ALIGN, dtype=torch.uint8, pin_memory=True)
        start = -t.data_ptr() % HOST_ALIGN
        return t[start : start + nbytes]

    def rng_state(self) -> Any:
        """Host and CUDA generator states."""
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: Any) -> None:
        """Restore host and CUDA generator states."""
        torch.set_rng_state(state[0])
        torch.cuda.set_rng_state(state[1], self.device)

    def current_stream(self) -> torch.cuda.Stream:
        """torch's current stream on this device: where forward/backward are issued."""
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        """A new non-default stream on this device."""
        return torch.cuda.Stream(self.device)

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """Issue torch work on ``stream``."""
        return torch.cuda.stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any | None = None) -> Event:
        """``dst.copy_(src, non_blocking=True)`` issued on ``stream`` (default: the current stream);
        an event after it."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        return self.record(stream)

    def record(self, stream: Any | None = None) -> Event:
        """An event after all work issued so far on ``stream`` (default: the current stream)."""
        return CUDAEvent(stream if stream is not None else torch.cuda.current_stream(self.device))

    def clock(self, stream: Any | None = None) -> Event:
        """A timed event after the work issued so far on ``stream`` (default: the current stream)."""
        return CUDAEvent(stream if stream is not None else torch.cuda.current_stream(self.device), self._clock)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator ``tensor`` is in use by ``stream`` (no reuse until done)."""
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def synchronize(self) -> None:
        """Block until all queued work on the device has completed."""
        torch.cuda.synchronize(self.device)

    def memory(self) -> MemoryStats:
        """Real allocator figures: allocated, peak, the capacity, and reserved — what the allocator
        holds, live tensors and cached free blocks, the figure the capacity caps (bytes)."""
        return MemoryStats(
            allocated=torch.cuda.memory_allocated(self.device),
            peak=torch.cuda.max_memory_allocated(self.device),
            capacity=self.capacity,
            reserved=torch.cuda.memory_reserved(self.device),
        )


def describe() -> str | None:
    """Name and memory of the visible GPU, or None without one (for ``fuyou doctor``)."""
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    return f"{p.name}, {format_size(p.total_memory)}, CUDA {torch.version.cuda}"
