"""The backend seam: everything the data path needs from an accelerator, in one small interface.

One code path serves CPU and GPU. The CPU backend (``cpu.py``) has null streams and completed
events and enforces a *fake* device capacity, so a tiny model that "does not fit" in 2 MB exercises
the same budget logic as 70B in 80 GB. Only ``cuda.py`` touches ``torch.cuda``.

Copies between host and device go through ``Backend.copy`` (not raw ``copy_`` under ``on(stream)``),
so a backend can run them asynchronously: the asynchronous CPU backend (``cpu_async.py``, a test mode
selected with ``FUYOU_CPU_ASYNC=1``) runs them on worker threads after random delays and poisons
released memory, so a missing wait fails on CPU the way it would corrupt data on a GPU.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from fuyou.errors import DeviceMemoryError
from fuyou.units import HOST_ALIGN, align_up, format_size  # noqa: F401 - HOST_ALIGN: re-exported


@dataclass(frozen=True)
class MemoryStats:
    """Device memory in bytes: currently allocated, peak since start, the usable capacity, and what
    the backend's allocator holds now (``reserved`` ≥ ``allocated``: live tensors plus cached free
    blocks; on CUDA ``torch.cuda.memory_reserved``, which ``--gpu-memory`` caps)."""

    allocated: int
    peak: int
    capacity: int
    reserved: int


class Event(ABC):
    """A point in a stream's work; ``wait`` orders later work (or the host) after it."""

    @abstractmethod
    def wait(self, stream: Any | None = None) -> None:
        """Make ``stream`` wait for this event; with ``None``, block the calling host thread."""

    @abstractmethod
    def query(self) -> bool:
        """Return True if the work before this event has completed."""

    def when(self) -> float | None:
        """When the device reached this event, in ``time.perf_counter`` seconds; None while it has
        not, or for an event not made by ``Backend.clock``."""
        return None


def host_aligned_empty(nbytes: int) -> torch.Tensor:
    """Allocate an uninitialised, page-aligned uint8 CPU tensor of exactly ``nbytes`` bytes.

    Backed by an anonymous mmap (page aligned, returned to the OS when the tensor dies). Pages
    are touched here, so later I/O into the buffer does not pay first-touch faults. The mapping is
    not inherited by forked children (``MADV_DONTFORK``, Linux): a DataLoader worker forked from a
    trainer holding gigabytes of (pinned) host buffers neither shares nor copies them; a child that
    touched one would fault (nothing in a worker does).
    """
    size = max(align_up(nbytes, HOST_ALIGN), HOST_ALIGN)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _dont_fork(mm)
    t = torch.frombuffer(mm, dtype=torch.uint8)  # keeps ``mm`` alive
    t.fill_(0)
    return t[:nbytes]


def _dont_fork(mm: mmap.mmap) -> None:
    """Keep ``mm`` out of forked children (``madvise(MADV_DONTFORK)``). Never raises: where the
    platform lacks the advice (not Linux) or the kernel refuses it, children inherit the mapping as
    before (hygiene, not correctness)."""
    flag = getattr(mmap, "MADV_DONTFORK", None)
    if flag is not None:
        try:
            mm.madvise(flag)
        except OSError:
            pass


def device_full(nbytes: int, used: int, capacity: int, what: object, verb: str = "allocating") -> DeviceMemoryError:
    """The one-line error for a device allocation of ``nbytes`` that would pass ``capacity`` (bytes)."""
    return DeviceMemoryError(
        f"device memory exhausted: {verb} {format_size(nbytes)} for {what} would bring use to "
        f"{format_size(used + nbytes)}, above the {format_size(capacity)} capacity; raise --gpu-memory "
        "or lower the micro-batch size or prefetch depth"
    )


class _DeviceAccounting:
    """Counts bytes of live device tensors against a capacity, exactly, via storage finalizers."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.allocated = 0
        self.peak = 0
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()

    def charge(self, nbytes: int, what: object) -> None:
        """Reserve ``nbytes``; raise DeviceMemoryError if that passes the capacity."""
        with self._lock:
            if self.allocated + nbytes > self.capacity:
                raise device_full(nbytes, self.allocated, self.capacity, what)
            self.allocated += nbytes
            self.peak = max(self.peak, self.allocated)

    def refund(self, nbytes: int) -> None:
        """Return ``nbytes`` to the pool (called when the tensor's storage is freed)."""
        with self._lock:
            self.allocated -= nbytes

    def track(self, tensor: torch.Tensor, nbytes: int) -> None:
        """Refund what ``tensor``'s storage still holds when it (shared by all views) is freed."""
        storage = tensor.untyped_storage()
        self._held[id(storage)] = nbytes
        weakref.finalize(storage, self._release, id(storage))

    def adopt(self, storage: torch.UntypedStorage, what: object) -> None:
        """Charge ``storage`` (allocated by torch during compute) until it is freed; DeviceMemoryError
        naming ``what`` past the capacity. Idempotent."""
        key = id(storage)
        with self._lock:
            if key in self._held:
                return
        n = storage.nbytes()
        self.charge(n, what)
        self._held[key] = n
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.refund(self._held.pop(key, 0))

    def forget(self, storage: torch.UntypedStorage) -> None:
        """Refund what ``storage`` holds now, not when it is freed: its tensors are gone, only queued
        copies still reference it (the asynchronous CPU backend)."""
        self._release(id(storage))

    def resize(self, tensor: torch.Tensor, nbytes: int, what: str) -> None:
        """Charge or refund the change of ``tensor``'s storage to ``nbytes`` (before resizing it)."""
        key = id(tensor.untyped_storage())
        old = self._held.get(key, 0)
        if nbytes > old:
            self.charge(nbytes - old, what)
        else:
            self.refund(old - nbytes)
        self._held[key] = nbytes


class Backend(ABC):
    """The operations the engine needs from a device; see the module docstring."""

    name: str
    device: torch.device

    def describe(self) -> str:
        """The device's model in words (the GPU's name and memory; ``cpu`` for the CPU backend)."""
        return self.name

    @abstractmethod
    def host_empty(self, nbytes: int, pinned: bool = True) -> torch.Tensor:
        """A page-aligned uint8 host tensor of exactly ``nbytes``, not inherited by forked children.

        ``pinned``: the buffer crosses PCIe (host ↔ device copies), so CUDA page-locks it; memory
        only the host touches (optimizer state, the RAM tier: ``fuyou.schedule.sizing.crosses_pcie``)
        asks for ``pinned=False`` and stays pageable. The CPU backends ignore it.
        """

    @abstractmethod
    def device_empty(
        self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "a tensor", stream: Any | None = None
    ) -> torch.Tensor:
        """An uninitialised device tensor, counted against the capacity.

        ``stream``: the stream that first uses the memory (None: the current stream). On CUDA the
        caching allocator hands it out from that stream's pool, so a copy issued there needs no wait
        for compute to be done with recycled memory (the FSDP pattern); every other stream that uses
        it must be named with ``keep_alive`` before the memory is dropped, and the engine does that
        at once. Raises DeviceMemoryError naming ``what`` if it would pass the capacity.
        """

    def free_storage(self, tensor: torch.Tensor) -> None:
        """Release the device memory under ``tensor`` and all its views, keeping their metadata.

        Parameters and autograd's saved views of them stay valid objects; ``restore_storage``
        gives the memory back before they are used again (the FSDP technique).
        """
        self._account_resize(tensor, 0, "")
        tensor.untyped_storage().resize_(0)

    def restore_storage(
        self, tensor: torch.Tensor, nbytes: int, what: str = "a tensor", stream: Any | None = None
    ) -> torch.Tensor:
        """Re-allocate ``nbytes`` under a tensor freed by ``free_storage``; return a flat uint8 alias.

        Fill the alias (not ``tensor``), so autograd's version counters of the views are not bumped.
        ``stream``: as for ``device_empty`` (here unused: the CUDA backend allocates under it).
        Raises DeviceMemoryError naming ``what`` past the capacity.
        """
        self._account_resize(tensor, nbytes, what)
        storage = tensor.untyped_storage()
        storage.resize_(nbytes)
        return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (nbytes,))  # type: ignore[call-overload]  # torch's stubs lack set_(source, offset, size) (stride optional at runtime)

    def _account_resize(self, tensor: torch.Tensor, nbytes: int, what: str) -> None:  # noqa: B027 (optional hook)
        """Hook for backends that count device memory themselves (the CPU backend)."""

    def counting(self, what: str) -> AbstractContextManager[Any]:
        """Context around compute (forward, backward, the loss, an on-device optimizer step) in which
        every tensor torch allocates on the calling thread is device memory counted against the
        capacity, raising DeviceMemoryError naming ``what`` past it. Nothing to do where the
        allocator sees every tensor itself (CUDA); the CPU backend counts them
        (``cpu_allocations``)."""
        return nullcontext()

    def rng_state(self) -> Any:
        """Random-generator state of host and device (dropout replay for recomputation)."""
        return torch.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        """Restore a state from ``rng_state``."""
        torch.set_rng_state(state)

    def current_stream(self) -> Any:
        """The stream torch issues work on right now (where the model's compute runs); None on CPU."""
        return None

    @abstractmethod
    def new_stream(self) -> Any:
        """A new stream for copies that should overlap compute (a null stream on CPU)."""

    @abstractmethod
    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """Context in which torch work is issued on ``stream``."""

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any | None = None) -> Event:
        """Copy ``src`` into ``dst`` (same shape; host ↔ device) on ``stream``; return an event after it.

        Asynchronous where the backend can be (CUDA: ``non_blocking`` on ``stream``, the host side
        pinned), so the caller must order ``stream`` after whatever last wrote or used ``dst`` and
        ``src`` (``record().wait(stream)``), wait on the event before reading ``dst`` or reusing
        ``src``, and ``keep_alive`` device memory it drops before then. ``None``: the current stream.
        """

    @abstractmethod
    def record(self, stream: Any | None = None) -> Event:
        """An event marking all work issued so far on ``stream`` (default: the current stream)."""

    def clock(self, stream: Any | None = None) -> Event:
        """Like ``record``, and the event knows when the device reached it (``Event.when``): the
        timeline's device-timed spans (CUDA events with timing on a GPU)."""
        return self.record(stream)

    @abstractmethod
    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from being reused until ``stream``'s queued work is done."""

    def host_staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for a transient copy off or onto the device (swapped activations): pinned on
        CUDA, from torch's caching host allocator (allocated per step, so not registered one by one
        like ``host_empty``'s long-lived buffers); plain memory here. The caller charges it to the host
        budget."""
        return torch.empty(shape, dtype=dtype)

    def host_staging_aligned(self, nbytes: int) -> torch.Tensor:
        """A page-aligned uint8 host tensor of exactly ``nbytes`` for a transient copy that also goes
        through O_DIRECT I/O (activations read back from SSD, then copied onto the device): pinned on
        CUDA where its caching host allocator hands out page-aligned memory; page-aligned pageable
        memory here. The caller charges it to the host budget."""
        return host_aligned_empty(nbytes)

    def poison(self, tensor: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """``tensor``'s memory was just given back (a host buffer returned to its pool): nothing to do
        here; the asynchronous CPU backend overwrites it with 0xFF bytes (NaN in every float dtype)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all queued device work has completed."""

    @abstractmethod
    def memory(self) -> MemoryStats:
        """Current device memory use, peak and capacity (bytes)."""
