"""The I/O backend interface: asynchronous, checksummed block I/O between files and host buffers.

A request (one extent piece) is cut into blocks of ``block_bytes`` (4 KiB multiples); each block is
a task on the backend's thread pool, so many requests and many blocks are in flight at once (queue
depth = threads). Each block's CRC32C is computed in the same task, overlapped with other blocks'
I/O. Subclasses only say how a file is opened and closed and how one block is read or written.

Open files: a ``FileHandle`` is a path, not an open file. The backend opens files when a task needs
them and keeps at most ``max_open`` open (least recently used closed first, never one in use; see
``open_files.py``), so a store of any size runs under a small ``ulimit -n``.
"""

from __future__ import annotations

import errno
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from fuyou.errors import ChecksumError, FuyouError, StoreError, StoreSpaceError, os_limit_error
from fuyou.storage import checksum
from fuyou.storage.extents import FILE_ALIGN
from fuyou.storage.open_files import FileHandle, OpenFiles, default_capacity

__all__ = ["FileHandle", "IOBackend", "gather", "os_error", "then"]


def gather(futures: list[Future]) -> Future:
    """A future that completes when all ``futures`` have, with their results in order.

    It fails with the first failure (by position), but only after *every* future has finished, so
    no block is still writing into a buffer when the caller learns of the error.
    """
    out: Future = Future()
    if not futures:
        out.set_result([])
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result([f.result() for f in futures])

    for f in futures:
        f.add_done_callback(done)
    return out


def then(fut: Future, fn: Callable[[Any], Any]) -> Future:
    """A future for ``fn(fut.result())``, run in whichever thread completes ``fut``."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 - surfaced through the future
            out.set_exception(e)

    fut.add_done_callback(done)
    return out


def os_error(e: OSError, path: str, action: str) -> FuyouError:
    """Turn an OSError from ``action`` on ``path`` into a one-line error with a hint.

    Operating-system limits (EMFILE, ENFILE, ENOMEM) become SystemLimitError naming the limit and
    its fix (never blamed on the file); a full disk StoreSpaceError; anything else StoreError.
    """
    limit = os_limit_error(e, f"{action} {path}")
    if limit is not None:
        return limit
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreSpaceError(f"disk full while {action} {path}; free space or add another --ssd directory")
    return StoreError(f"{action} {path} failed: {e.strerror or e}; check the disk and its permissions")


class IOBackend(ABC):
    """Thread-pooled block I/O with per-block CRC32C; see the module docstring."""

    name: str
    fds_per_file: int = 1
    """Descriptors one open file of this backend holds (for the open-file cap)."""

    def __init__(self, threads: int = 16, block_bytes: int = 1 << 20, max_open: int | None = None) -> None:
        """Start ``threads`` I/O threads moving blocks of ``block_bytes``; keep at most ``max_open``
        files open (default: ``open_files.default_capacity``, a quarter of ``ulimit -n``).

        Raises StoreError if ``block_bytes`` is not a positive multiple of 4 KiB or ``max_open`` < 1.
        """
        if block_bytes <= 0 or block_bytes % FILE_ALIGN:
            raise StoreError(f"I/O block size must be a positive multiple of {FILE_ALIGN}, got {block_bytes}")
        self.threads = threads
        self.block_bytes = block_bytes
        cap = default_capacity(threads, self.fds_per_file) if max_open is None else max_open
        self.files = OpenFiles(self._open_raw, self._close_raw, cap)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"fuyou-io-{self.name}")

    def open(self, path: str, direct: bool) -> FileHandle:
        """A handle on the existing file ``path`` (read-write, O_DIRECT when ``direct``).

        The file is opened when I/O needs it. Raises StoreError if ``path`` is not a file.
        """
        if not os.path.isfile(path):
            raise StoreError(f"{path} does not exist or is not a file")
        return FileHandle(path, direct)

    def close(self, handle: FileHandle) -> None:
        """Close ``handle`` (at once, or when the I/O using it finishes); later I/O on it fails."""
        self.files.forget(handle)

    @abstractmethod
    def _open_raw(self, path: str, direct: bool) -> Any:
        """Open ``path`` read-write (O_DIRECT when ``direct``); return this backend's raw handle.

        Raises OSError on failure.
        """

    @abstractmethod
    def _close_raw(self, raw: Any) -> None:
        """Close a raw handle returned by ``_open_raw``."""

    @abstractmethod
    def _read_block(self, raw: Any, h: FileHandle, arr: np.ndarray, offset: int) -> None:
        """Fill ``arr`` (uint8) from the open file ``raw`` (of ``h``) at byte ``offset`` (4 KiB aligned)."""

    @abstractmethod
    def _write_block(self, raw: Any, h: FileHandle, arr: np.ndarray, offset: int) -> None:
        """Write ``arr`` (uint8) at byte ``offset`` (4 KiB aligned); a short tail is zero padded."""

    @abstractmethod
    def _fsync(self, raw: Any, h: FileHandle) -> None:
        """Flush the file's data and metadata to stable storage."""

    def _blocks(self, n: int) -> list[tuple[int, int]]:
        return [(s, min(self.block_bytes, n - s)) for s in range(0, n, self.block_bytes)]

    def read(
        self, h: FileHandle, arr: np.ndarray, expected: list[int] | None, label: str, compute: bool = True
    ) -> Future:
        """Read ``arr.size`` bytes from the start of ``h`` into ``arr``; verify block CRCs if given.

        With ``compute`` false and no ``expected``, no checksum is computed (results are 0).

        The future resolves to the block CRCs; it fails with ChecksumError naming the file, byte
        offset and ``label`` on a mismatch, or StoreError on an I/O error.
        """
        blocks = self._blocks(arr.size)
        if expected is not None and len(expected) != len(blocks):
            raise ChecksumError(f"{h.path}: manifest has {len(expected)} checksums, layout needs {len(blocks)}")

        def task(i: int, start: int, n: int) -> int:
            try:
                raw = self.files.acquire(h)
                try:
                    self._read_block(raw, h, arr[start : start + n], start)
                finally:
                    self.files.release(h)
            except OSError as e:
                raise os_error(e, h.path, "reading") from e
            if expected is None and not compute:
                return 0
            c = checksum.crc(arr[start : start + n])
            if expected is not None and c != expected[i]:
                raise ChecksumError(
                    f"checksum mismatch in {h.path} at bytes {start}..{start + n} ({label}): the file is "
                    "corrupted; restore the run from a checkpoint"
                )
            return c

        return gather([self._pool.submit(task, i, s, n) for i, (s, n) in enumerate(blocks)])

    def write(self, h: FileHandle, arr: np.ndarray, compute: bool = True) -> Future:
        """Write ``arr`` to the start of ``h``; the future resolves to the block CRCs (0 if not ``compute``)."""

        def task(start: int, n: int) -> int:
            c = checksum.crc(arr[start : start + n]) if compute else 0
            try:
                raw = self.files.acquire(h)
                try:
                    self._write_block(raw, h, arr[start : start + n], start)
                finally:
                    self.files.release(h)
            except OSError as e:
                raise os_error(e, h.path, "writing") from e
            return c

        return gather([self._pool.submit(task, s, n) for s, n in self._blocks(arr.size)])

    def fsync(self, h: FileHandle) -> Future:
        """Flush ``h`` to stable storage on the pool."""

        def task() -> None:
            try:
                with self.files.use(h) as raw:
                    self._fsync(raw, h)
            except OSError as e:
                raise os_error(e, h.path, "syncing") from e

        return self._pool.submit(task)

    def shutdown(self) -> None:
        """Wait for queued I/O, stop the threads and close every file still open."""
        self._pool.shutdown(wait=True)
        self.files.close_all()
