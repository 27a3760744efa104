"""POSIX I/O backend: ``os.preadv``/``os.pwritev`` (GIL released) on a thread pool, O_DIRECT or not.

With O_DIRECT the page cache is bypassed (it would eat the RAM budget and make timings lie). Buffer
addresses and file offsets must then be 4 KiB aligned: pool buffers are; a misaligned buffer (a
block at a time) or a tail shorter than 4 KiB goes through a per-thread aligned bounce buffer of
one block.

Raw handles are file descriptors (ints), opened on demand and capped by the base class's cache.
Subclasses may hold another object per file and say how to reach its descriptor (``_fd``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from fuyou.device.base import host_aligned_empty
from fuyou.errors import StoreError
from fuyou.storage.extents import FILE_ALIGN
from fuyou.storage.io_base import FileHandle, IOBackend


def _full(op, fd: int, mv: memoryview, offset: int, path: str) -> None:
    """Repeat ``op`` (preadv/pwritev) until all of ``mv`` is transferred."""
    done = 0
    while done < len(mv):
        n = op(fd, [mv[done:]], offset + done)
        if n == 0:
            raise StoreError(f"{path} is truncated: no data at byte {offset + done}; the file is damaged")
        done += n


class PosixIO(IOBackend):
    """Thread-pool POSIX I/O; see the module docstring."""

    name = "posix"

    def _open_raw(self, path: str, direct: bool) -> Any:
        """A descriptor of ``path``, read-write, with O_DIRECT when ``direct``."""
        return os.open(path, os.O_RDWR | (os.O_DIRECT if direct else 0))

    def _close_raw(self, raw: Any) -> None:
        os.close(raw)

    def _fd(self, raw: Any) -> int:
        """The descriptor behind a raw handle (the handle itself here)."""
        return raw

    def _bounce(self) -> np.ndarray:
        b = getattr(self._local, "bounce", None)
        if b is None:
            b = self._local.bounce = host_aligned_empty(self.block_bytes).numpy()
        return b

    def _split(self, h: FileHandle, arr: np.ndarray) -> tuple[int, bool]:
        """Bytes of ``arr`` that can go direct, and whether its address is aligned."""
        if not h.direct:
            return arr.size, True
        return arr.size & ~(FILE_ALIGN - 1), arr.ctypes.data % FILE_ALIGN == 0

    def _read_block(self, raw: Any, h: FileHandle, arr: np.ndarray, offset: int) -> None:
        fd = self._fd(raw)
        body, aligned = self._split(h, arr)
        if aligned:
            _full(os.preadv, fd, arr[:body].data, offset, h.path)
        else:  # through the bounce buffer, a block at a time
            bounce = self._bounce()
            for s in range(0, body, bounce.size):
                k = min(bounce.size, body - s)
                _full(os.preadv, fd, bounce[:k].data, offset + s, h.path)
                arr[s : s + k] = bounce[:k]
        tail = arr.size - body
        if tail:
            bounce = self._bounce()
            _full(os.preadv, fd, bounce[:FILE_ALIGN].data, offset + body, h.path)
            arr[body:] = bounce[:tail]

    def _write_block(self, raw: Any, h: FileHandle, arr: np.ndarray, offset: int) -> None:
        fd = self._fd(raw)
        body, aligned = self._split(h, arr)
        if aligned:
            _full(os.pwritev, fd, arr[:body].data, offset, h.path)
        else:  # through the bounce buffer, a block at a time
            bounce = self._bounce()
            for s in range(0, body, bounce.size):
                k = min(bounce.size, body - s)
                bounce[:k] = arr[s : s + k]
                _full(os.pwritev, fd, bounce[:k].data, offset + s, h.path)
        tail = arr.size - body
        if tail:
            bounce = self._bounce()
            bounce[:tail] = arr[body:]
            bounce[tail:FILE_ALIGN] = 0
            _full(os.pwritev, fd, bounce[:FILE_ALIGN].data, offset + body, h.path)

    def _fsync(self, raw: Any, h: FileHandle) -> None:
        os.fsync(self._fd(raw))
