"""kvikio I/O engine (RAPIDS): GPUDirect Storage where the system has it, its POSIX compat mode else.

kvikio cannot do any I/O without a CUDA driver (it loads ``libcuda.so.1`` even for host buffers),
so it is only selected when ``kvikio_usable()`` — never required on CPU. Blocks are fanned out on
Fuyou's pool (which also computes checksums); each block is one kvikio ``pread``/``pwrite``.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from fuyou.errors import StoreError
from fuyou.storage.io_base import FileHandle, IOEngine


def kvikio_usable() -> bool:
    """True if a CUDA driver is loadable and the ``kvikio`` package imports."""
    try:
        ctypes.CDLL("libcuda.so.1")
        import kvikio  # noqa: F401
    except (OSError, ImportError):
        return False
    return True


class KvikioEngine(IOEngine):
    """kvikio-backed block I/O; see the module docstring."""

    name = "kvikio"

    def __init__(self, threads: int = 16, block_bytes: int = 1 << 20) -> None:
        if not kvikio_usable():
            raise StoreError("kvikio I/O needs the kvikio package and a CUDA driver; use io='posix'")
        import kvikio

        self._kvikio: Any = kvikio
        super().__init__(threads, block_bytes)

    def open(self, path: str, direct: bool) -> FileHandle:
        """Open ``path`` with kvikio (``r+``); kvikio decides GDS vs compat mode itself."""
        if not os.path.exists(path):
            raise StoreError(f"{path} does not exist")
        return FileHandle(path, direct, self._kvikio.CuFile(path, "r+"))

    def close(self, handle: FileHandle) -> None:
        """Close the kvikio file."""
        handle.raw.close()

    def _read_block(self, h: FileHandle, arr: np.ndarray, offset: int) -> None:
        n = h.raw.pread(arr, arr.size, offset).get()
        if n != arr.size:
            raise StoreError(f"{h.path} is truncated: read {n} of {arr.size} bytes at byte {offset}")

    def _write_block(self, h: FileHandle, arr: np.ndarray, offset: int) -> None:
        n = h.raw.pwrite(arr, arr.size, offset).get()
        if n != arr.size:
            raise StoreError(f"short write to {h.path}: {n} of {arr.size} bytes at byte {offset}")

    def _fsync(self, h: FileHandle) -> None:
        fd = os.open(h.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
