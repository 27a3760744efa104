"""A fixed pool of pre-allocated host buffers, accounted against a host budget.

Buffers are created once, at ``reserve`` time, in named classes of equal-size buffers (e.g. 4 ×
"layer weights"). ``acquire`` blocks until one is free, so a full pool is back-pressure, not an
allocation: nothing is allocated per step. A class is pinned on CUDA only if its buffers cross PCIe
(``fuyou.schedule.sizing.crosses_pcie``: weights and gradients, not optimizer state or the RAM tier).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from fuyou.device.base import HOST_ALIGN, Backend
from fuyou.errors import ConfigError, FuyouError, HostMemoryError
from fuyou.schedule.sizing import crosses_pcie
from fuyou.units import align_up, format_size


@dataclass(eq=False)
class HostBuffer:
    """One pool buffer: a page-aligned uint8 tensor of ``nbytes`` bytes, owned by ``kind``."""

    kind: str
    index: int
    data: torch.Tensor = field(repr=False)

    @property
    def nbytes(self) -> int:
        """Usable size in bytes."""
        return self.data.numel()

    def view(self, dtype: torch.dtype, numel: int, offset: int = 0) -> torch.Tensor:
        """A flat ``dtype`` view of ``numel`` elements starting ``offset`` bytes in.

        Raises ConfigError if the view does not fit or ``offset`` is misaligned for ``dtype``.
        """
        size = torch.empty((), dtype=dtype).element_size()
        if offset % size or offset + numel * size > self.nbytes:
            raise ConfigError(
                f"view of {numel} × {dtype} at byte {offset} does not fit buffer {self.kind}[{self.index}] "
                f"of {self.nbytes} bytes"
            )
        return self.data[offset : offset + numel * size].view(dtype)


WAYS_OUT = (
    "raise --cpu-memory, lower --prefetch-depth, park gradients on SSD (Plan.park_ram_blocks; "
    "--plan auto/rules do so when RAM is short), or turn clipping off (--max-grad-norm 0)"
)
"""Every way out of a host budget that is too small, for the one-line error."""


class HostBufferPool:
    """Fixed host buffers in named classes, within ``budget`` bytes of host memory."""

    def __init__(self, backend: Backend, budget: int) -> None:
        self.backend = backend
        self.budget = budget
        self.reserved = 0
        self.peak = 0
        self.pinned = 0
        """Bytes of reserved buffers asked for pinned (page-rounded): the classes that cross PCIe."""
        self._free: dict[str, list[HostBuffer]] = {}
        self._sizes: dict[str, tuple[int, int]] = {}
        self._cond = threading.Condition()

    def reserve(self, kind: str, nbytes: int, count: int) -> None:
        """Pre-allocate ``count`` buffers of ``nbytes`` each in class ``kind``, pinned if the class
        crosses PCIe (``crosses_pcie``).

        Sizes are rounded up to 4 KiB for the budget. Raises HostMemoryError if the budget would
        be passed (naming what is already reserved), ConfigError if ``kind`` exists already,
        FuyouError if the backend cannot pin the buffers (CUDA: ``ulimit -l`` too low).
        """
        if kind in self._sizes:
            raise ConfigError(f"host buffer class {kind!r} is already reserved")
        need = align_up(nbytes, HOST_ALIGN) * count
        if self.reserved + need > self.budget:
            raise HostMemoryError(
                f"host buffers need {format_size(self.reserved + need)} ({self._describe({**self._sizes, kind: (nbytes, count)})})"
                f" but the host budget is {format_size(self.budget)}; {WAYS_OUT}"
            )
        pinned = crosses_pcie(kind)
        bufs = [HostBuffer(kind, i, self.backend.host_empty(nbytes, pinned=pinned)) for i in range(count)]
        with self._cond:
            self._sizes[kind] = (nbytes, count)
            self._free[kind] = bufs
            self.reserved += need
            self.pinned += need if pinned else 0
            self.peak = max(self.peak, self.reserved)

    @staticmethod
    def _describe(sizes: dict[str, tuple[int, int]]) -> str:
        """Buffer classes in words, classes of one family (``park/0``, ``park/1``, …) as one entry."""
        groups: dict[str, list[int]] = {}
        for k, (n, c) in sizes.items():
            groups.setdefault(k.split("/")[0], []).extend([align_up(n, HOST_ALIGN)] * c)
        parts = []
        for k, sizes_ in groups.items():
            if len(set(sizes_)) == 1:
                parts.append(f"{len(sizes_)} × {format_size(sizes_[0])} {k}")
            else:
                parts.append(f"{len(sizes_)} {k} buffers, {format_size(sum(sizes_))}")
        return ", ".join(parts)

    def acquire(self, kind: str, timeout: float | None = None) -> HostBuffer:
        """Take a free buffer of class ``kind``, waiting up to ``timeout`` seconds (None: forever).

        Raises ConfigError for an unknown class; FuyouError if none frees up in time (a schedule
        that never releases is a bug, and this turns its hang into an error).
        """
        with self._cond:
            if kind not in self._free:
                raise ConfigError(f"no host buffer class {kind!r}; reserve it first")
            if not self._cond.wait_for(lambda: bool(self._free[kind]), timeout):
                raise FuyouError(f"no free host buffer of class {kind!r} after {timeout} s")
            return self._free[kind].pop()

    def release(self, buf: HostBuffer) -> None:
        """Return ``buf`` to its class; raises ConfigError on a double release.

        The backend may poison its contents (the asynchronous CPU backend does: a copy or read still
        using a released buffer then sees NaN), so release only what nothing reads any more.
        """
        with self._cond:
            free = self._free[buf.kind]
            if any(b is buf for b in free):
                raise ConfigError(f"host buffer {buf.kind}[{buf.index}] released twice")
            self.backend.poison(buf.data)
            free.append(buf)
            self._cond.notify_all()

    def charge(self, nbytes: int, what: str) -> None:
        """Count a transient host allocation (e.g. swapped activations) against the budget.

        Raises HostMemoryError naming ``what`` if the budget would be passed.
        """
        with self._cond:
            if self.reserved + nbytes > self.budget:
                raise HostMemoryError(
                    f"{what} needs {format_size(nbytes)} of host memory beyond the {format_size(self.reserved)} in use; "
                    f"the host budget is {format_size(self.budget)}; raise --cpu-memory or swap activations to SSD "
                    "(or recompute them)"
                )
            self.reserved += nbytes
            self.peak = max(self.peak, self.reserved)

    def refund(self, nbytes: int) -> None:
        """Return a transient allocation counted with ``charge``."""
        with self._cond:
            self.reserved -= nbytes

    def available(self, kind: str) -> int:
        """Number of free buffers of class ``kind`` right now."""
        with self._cond:
            return len(self._free[kind])
