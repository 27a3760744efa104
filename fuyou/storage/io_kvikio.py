"""kvikio I/O backend (RAPIDS file I/O). Fuyou passes it host buffers, so data goes through host memory
(kvikio's POSIX path), never GPUDirect Storage, which needs device buffers.

kvikio cannot do any I/O without a CUDA driver (it loads ``libcuda.so.1`` even for host buffers),
so it is only used when asked for (``io="kvikio"``) and usable — never on CPU, and not by
``io="auto"`` until it is measured faster than the POSIX pool. Blocks are fanned out on Fuyou's
pool (which also computes checksums); each block is one kvikio ``pread``/``pwrite``. Handles are
``CuFile`` objects, not descriptors (``io_pyfile.PyFileIO`` stands in for them in CPU tests);
each may hold two descriptors (compat mode opens the file with and without O_DIRECT).

kvikio reports failed system calls as ``RuntimeError`` whose text quotes the C library's message
("No space left on device") or the errno's name; ``kvikio_os_error`` turns them back into ``OSError``
with that errno, so the store's one-line hints (``io_base.os_error``: disk full, open-file limit, …)
apply to kvikio as they do to the POSIX backend.

kvikio's defaults would serialise everything: its thread pool has one thread, and it reads through
the page cache (which then eats the host budget). ``KvikioIO`` sets, process-wide (``kvikio_settings``),
a pool of at least Fuyou's own I/O threads and, for files the store opens with O_DIRECT, kvikio's
opportunistic O_DIRECT reads and writes (it falls back where alignment or the filesystem refuse).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from fuyou.errors import StoreError, error_number
from fuyou.storage.dirs import fsync_path
from fuyou.storage.io_base import FileHandle, IOBackend

_KNOWN_ERRNOS = (
    errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
    errno.ENFILE, errno.EMFILE, errno.ENOMEM, errno.EFBIG, errno.EBADF, errno.EINVAL, errno.EFAULT,
)  # fmt: skip
"""The errnos ``kvikio_errno`` recognises by their message or name in kvikio's text."""


def kvikio_errno(e: BaseException) -> int | None:
    """The errno behind a kvikio ``RuntimeError``: one it carries or quotes as a number
    (``fuyou.errors.error_number``), else the first of ``_KNOWN_ERRNOS`` whose C-library message
    ("No space left on device") or name ("ENOSPC") its text contains; None if none."""
    code = error_number(e)
    if code is not None:
        return code
    text = str(e)
    low = text.lower()
    for code in _KNOWN_ERRNOS:
        if os.strerror(code).lower() in low or errno.errorcode[code] in text:
            return code
    return None


def kvikio_os_error(e: BaseException, what: str) -> OSError:
    """``e`` (kvikio's RuntimeError from ``what``) as an OSError with its errno (EIO if none is
    recognisable), for ``io_base.os_error`` to turn into a one-line hint."""
    code = kvikio_errno(e) or errno.EIO
    return OSError(code, f"{os.strerror(code)} ({what}: {e})")


def _call(what: str, fn: Callable[[], int]) -> int:
    """``fn()`` with kvikio's RuntimeError raised as OSError (``kvikio_os_error``)."""
    try:
        return fn()
    except RuntimeError as e:
        raise kvikio_os_error(e, what) from e


def kvikio_settings(threads: int, direct: bool, current_threads: int = 1) -> dict[str, Any]:
    """The kvikio defaults Fuyou sets: a thread pool of at least ``threads`` (never shrinking
    ``current_threads``), and opportunistic O_DIRECT reads and writes when ``direct``."""
    return {"num_threads": max(threads, current_threads), "auto_direct_io_read": direct,
            "auto_direct_io_write": direct}  # fmt: skip


def _apply(kvikio: Any, settings: dict[str, Any]) -> None:
    """Set kvikio's process-wide defaults (``kvikio.defaults.set``; older kvikio lacks the O_DIRECT
    settings: those are skipped, the thread pool is set through ``num_threads_reset``)."""
    d = kvikio.defaults
    for key, value in settings.items():
        try:
            if hasattr(d, "set"):
                d.set(key, value)
            elif key == "num_threads":
                d.num_threads_reset(value)
        except (KeyError, ValueError, RuntimeError, TypeError):
            if key == "num_threads":
                raise


def _threads(kvikio: Any) -> int:
    d = kvikio.defaults
    return int(d.get("num_threads") if hasattr(d, "get") else d.get_num_threads())


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

    def __init__(
        self,
        threads: int = 16,
        block_bytes: int = 1 << 20,
        max_open: int | None = None,
        request_bytes: int | None = None,
    ) -> None:
        if not kvikio_usable():
            raise StoreError("kvikio I/O needs the kvikio package and a CUDA driver; use io='posix'")
        import kvikio
        import kvikio.defaults  # a submodule the package does not import itself (kvikio >= 26)

        self._kvikio: Any = kvikio
        self._direct: bool | None = None
        _apply(kvikio, {"num_threads": kvikio_settings(threads, False, _threads(kvikio))["num_threads"]})
        super().__init__(threads, block_bytes, max_open, request_bytes)

    def _open_raw(self, path: str, direct: bool) -> Any:
        """A kvikio ``CuFile`` of ``path`` (``r+``) for I/O through host buffers.

        Raises OSError (with the errno kvikio reports, else EIO) if kvikio cannot open it.
        """
        if direct and not self._direct:  # the store asks O_DIRECT for this filesystem: turn kvikio's on
            settings = kvikio_settings(self.threads, True, _threads(self._kvikio))
            _apply(self._kvikio, {k: v for k, v in settings.items() if k != "num_threads"})
            self._direct = True
        try:
            return self._kvikio.CuFile(path, "r+")
        except RuntimeError as e:  # kvikio reports open failures as RuntimeError
            raise kvikio_os_error(e, "kvikio cannot open the file") from e

    def _close_raw(self, raw: Any) -> None:
        raw.close()

    def _read_block(self, raw: Any, h: FileHandle, arr: np.ndarray, offset: int) -> None:
        n = _call("kvikio pread", lambda: raw.pread(arr, arr.size, offset).get())
        if n != arr.size:
            raise StoreError(f"{h.path} is truncated: read {n} of {arr.size} bytes at byte {offset}")

    def _write_block(self, raw: Any, h: FileHandle, arr: np.ndarray, offset: int) -> None:
        n = _call("kvikio pwrite", lambda: raw.pwrite(arr, arr.size, offset).get())
        if n != arr.size:
            raise StoreError(f"short write to {h.path}: {n} of {arr.size} bytes at byte {offset}")

    def _fsync(self, raw: Any, h: FileHandle) -> None:
        fsync_path(h.path)
