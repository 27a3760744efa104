"""kvikio I/O backend (RAPIDS file I/O). Fuyou passes it host buffers, so data goes through host memory
(kvikio's POSIX path), never GPUDirect Storage, which needs device buffers.

kvikio cannot do any I/O without a CUDA driver (it loads ``libcuda.so.1`` even for host buffers),
so it is only used when asked for (``io="kvikio"``) and usable — never on CPU, and not by
``io="auto"`` until it is measured faster than the POSIX pool. Blocks are fanned out on Fuyou's
pool (which also computes checksums); each block is one kvikio ``pread``/``pwrite``. Handles are
``CuFile`` objects, not descriptors (``io_pyfile.PyFileIO`` stands in for them in CPU tests);
each may hold two descriptors (compat mode opens the file with and without O_DIRECT).
"""

from __future__ import annotations

import ctypes
import errno
from typing import Any

import numpy as np

from fuyou.errors import StoreError, error_number
from fuyou.storage.dirs import fsync_path
from fuyou.storage.io_base import FileHandle, IOBackend


def kvikio_usable() -> bool:
    """True if a CUDA driver is loadable and the ``kvikio`` package imports."""
    try:
        ctypes.CDLL("libcuda.so.1")
        import kvikio  # noqa: F401
    except (OSError, ImportError):
        return False
    return True


class KvikioIO(IOBackend):
    """kvikio-backed block I/O; see the module docstring."""

    name = "kvikio"
    fds_per_file = 2

    def __init__(self, threads: int = 16, block_bytes: int = 1 << 20, max_open: int | None = None) -> None:
        if not kvikio_usable():
            raise StoreError("kvikio I/O needs the kvikio package and a CUDA driver; use io='posix'")
        import kvikio

        self._kvikio: Any = kvikio
        super().__init__(threads, block_bytes, max_open)

    def _open_raw(self, path: str, direct: bool) -> Any:
        """A kvikio ``CuFile`` of ``path`` (``r+``) for I/O through host buffers.

        Raises OSError (with the errno kvikio reports, else EIO) if kvikio cannot open it.
        """
        try:
            return self._kvikio.CuFile(path, "r+")
        except RuntimeError as e:  # kvikio reports open failures as RuntimeError
            raise OSError(error_number(e) or errno.EIO, f"kvikio cannot open the file: {e}") from e

    def _close_raw(self, raw: Any) -> None:
        raw.close()

    def _read_block(self, raw: Any, h: FileHandle, arr: np.ndarray, offset: int) -> None:
        n = raw.pread(arr, arr.size, offset).get()
        if n != arr.size:
            raise StoreError(f"{h.path} is truncated: read {n} of {arr.size} bytes at byte {offset}")

    def _write_block(self, raw: Any, h: FileHandle, arr: np.ndarray, offset: int) -> None:
        n = raw.pwrite(arr, arr.size, offset).get()
        if n != arr.size:
            raise StoreError(f"short write to {h.path}: {n} of {arr.size} bytes at byte {offset}")

    def _fsync(self, raw: Any, h: FileHandle) -> None:
        fsync_path(h.path)
