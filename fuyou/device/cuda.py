"""The CUDA backend: the only module in Fuyou that touches ``torch.cuda``.

Host buffers are page-aligned anonymous mmaps registered with ``cudaHostRegister`` — pinned at
their exact size (torch's pinned caching allocator rounds to powers of two) and 4 KiB aligned so
the same buffer serves O_DIRECT/kvikio reads and async H2D copies.
"""

from __future__ import annotations

import math
import weakref
from contextlib import AbstractContextManager
from typing import Any

import torch

from fuyou.device.base import Backend, Event, MemoryStats, device_full, host_aligned_empty
from fuyou.errors import FuyouError
from fuyou.units import format_size


def cuda_available() -> bool:
    """True if torch sees a CUDA device."""
    return torch.cuda.is_available()


class CUDAEvent(Event):
    """A recorded ``torch.cuda.Event``."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._ev = torch.cuda.Event()
        self._ev.record(stream)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` after this event, or block the host when ``stream`` is None."""
        if stream is None:
            self._ev.synchronize()
        else:
            stream.wait_event(self._ev)

    def query(self) -> bool:
        """True once the recorded work has completed."""
        return self._ev.query()


class CUDABackend(Backend):
    """One CUDA device; ``capacity`` (bytes) caps what Fuyou lets the allocator hand out."""

    name = "cuda"

    def __init__(self, capacity: int | None = None, index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise FuyouError("no CUDA device is visible; use --device cpu or check the driver (nvidia-smi)")
        self.device = torch.device("cuda", index)
        total = torch.cuda.get_device_properties(self.device).total_memory
        self.capacity = total if capacity is None else min(capacity, total)
        self._cudart = torch.cuda.cudart()

    def describe(self) -> str:
        """The GPU's name, memory and CUDA version."""
        p = torch.cuda.get_device_properties(self.device)
        return f"{p.name}, {format_size(p.total_memory)}, CUDA {torch.version.cuda}"

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """A page-aligned uint8 host tensor of exactly ``nbytes``, pinned with cudaHostRegister.

        Raises FuyouError if registration fails (typically ``ulimit -l`` too low).
        """
        t = host_aligned_empty(nbytes)
        ptr, size = t.data_ptr(), t.untyped_storage().nbytes()
        err = self._cudart.cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            raise FuyouError(
                f"cannot pin {format_size(size)} of host memory (cudaHostRegister error {int(err)}); "
                "raise the locked-memory limit (ulimit -l unlimited) or lower --cpu-memory"
            )
        weakref.finalize(t.untyped_storage(), self._cudart.cudaHostUnregister, ptr)
        return t

    def device_empty(self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "a tensor") -> torch.Tensor:
        """A CUDA tensor; raises DeviceMemoryError naming ``what`` past the capacity."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        used = torch.cuda.memory_allocated(self.device)
        if used + nbytes > self.capacity:
            raise device_full(nbytes, used, self.capacity, what)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _account_resize(self, tensor: torch.Tensor, nbytes: int, what: str) -> None:
        """Refuse a restore that would pass the capacity (the allocator counts the rest)."""
        used = torch.cuda.memory_allocated(self.device)
        if nbytes and used + nbytes > self.capacity:
            raise device_full(nbytes, used, self.capacity, what, verb="restoring")

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

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator ``tensor`` is in use by ``stream`` (no reuse until done)."""
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def synchronize(self) -> None:
        """Block until all queued work on the device has completed."""
        torch.cuda.synchronize(self.device)

    def memory(self) -> MemoryStats:
        """Real allocator figures: allocated, peak, and the usable capacity (bytes)."""
        return MemoryStats(
            allocated=torch.cuda.memory_allocated(self.device),
            peak=torch.cuda.max_memory_allocated(self.device),
            capacity=self.capacity,
        )


def describe() -> str | None:
    """Name and memory of the visible GPU, or None without one (for ``fuyou doctor``)."""
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    return f"{p.name}, {format_size(p.total_memory)}, CUDA {torch.version.cuda}"


def current_stream_ptr(device: torch.device) -> int:
    """Raw ``cudaStream_t`` of torch's current stream on ``device`` (for cupy kernels)."""
    return torch.cuda.current_stream(device).cuda_stream
