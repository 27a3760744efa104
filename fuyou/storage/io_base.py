"""The I/O backend interface: asynchronous, checksummed block I/O between files and host buffers.

A request (one extent piece) is cut into blocks of ``block_bytes`` (4 KiB multiples), the unit of
the checksums. Runs of consecutive blocks, up to ``request_bytes``, are tasks on the backend's
thread pool, each one system call, so many requests and many runs are in flight at once (queue
depth = threads). Each block's CRC32C is computed in its run's task, overlapped with other runs'
I/O. Subclasses only say how a file is opened and closed and how one run is read or written.

Open files: a ``FileHandle`` is a path, not an open file. The backend opens files when a task needs
them and keeps at most ``max_open`` open (least recently used closed first, never one in use; see
``open_files.py``), so a store of any size runs under a small ``ulimit -n``.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from fuyou.device.host_threads import serial_worker
from fuyou.errors import ChecksumError, FuyouError, StoreError, StoreSpaceError, os_limit_error
from fuyou.storage import checksum
from fuyou.storage.cpu_meter import CpuMeter, stage_of_path
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


def _flat(fut: Future) -> Future:
    """A future for the concatenation of the lists ``fut`` resolves to (per-task CRC lists)."""
    return then(fut, lambda lists: [c for part in lists for c in part])


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


REQUEST_BYTES = 16 << 20
"""Default bytes per I/O task and system call. Each call and each task costs CPU whatever its size
(the syscall's setup, the pool's queue, futures and callbacks): on the dev machine's virtio disk an
O_DIRECT ``preadv`` costs 0.068 CPU-s/GB at 1 MiB, 0.045 at 4 MiB, 0.027 at 16 MiB, and a whole
training step's I/O threads 2.87 → 2.23 → 1.62 CPU-s (SmolLM2-135M, fp32, 5.5 GB moved;
``bench/bench_io_cpu.py``, ``bench/RESULTS.md``). The kernel still cuts a call into device-sized
requests (``max_sectors_kb``), so the drive's queue stays as deep."""


class IOBackend(ABC):
    """Thread-pooled block I/O with per-block CRC32C; see the module docstring."""

    name: str
    fds_per_file: int = 1
    """Descriptors one open file of this backend holds (for the open-file cap)."""

    def __init__(
        self,
        threads: int = 16,
        block_bytes: int = 1 << 20,
        max_open: int | None = None,
        request_bytes: int | None = None,
    ) -> None:
        """Start ``threads`` I/O threads moving runs of blocks of ``block_bytes`` (the checksum unit),
        at most ``request_bytes`` per system call (default ``REQUEST_BYTES``, rounded down to whole
        blocks, at least one); keep at most ``max_open`` files open (default:
        ``open_files.default_capacity``, a quarter of ``ulimit -n``).

        Raises StoreError if ``block_bytes`` is not a positive multiple of 4 KiB or ``max_open`` < 1.
        """
        if block_bytes <= 0 or block_bytes % FILE_ALIGN:
            raise StoreError(f"I/O block size must be a positive multiple of {FILE_ALIGN}, got {block_bytes}")
        self.threads = threads
        self.block_bytes = block_bytes
        want = REQUEST_BYTES if request_bytes is None else request_bytes
        self.request_bytes = max(block_bytes, want - want % block_bytes)
        """Bytes one task moves in one system call: whole blocks (each still checksummed alone)."""
        cap = default_capacity(threads, self.fds_per_file) if max_open is None else max_open
        self.files = OpenFiles(self._open_raw, self._close_raw, cap)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"fuyou-io-{self.name}", initializer=serial_worker)
        self.meter: CpuMeter | None = None
        """Where block tasks charge their CPU time (``cpu_meter``); None: not measured."""
        self._local = threading.local()
        """Per-I/O-thread scratch of a backend (the POSIX engine's bounce buffer)."""

    def _charge(self, h: FileHandle, op: str, t0: float, nbytes: int) -> None:
        """Charge the calling thread's CPU time since ``t0`` (``time.thread_time``) to ``h``'s stage."""
        meter = self.meter
        if meter is not None:
            meter.add(h.stage or stage_of_path(h.path), op, time.thread_time() - t0, nbytes)

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

    def _runs(self, n: int) -> list[tuple[int, int, int]]:
        """The tasks of an ``n``-byte request: (first block's index, start byte, length), each a run of
        whole blocks of at most ``request_bytes`` (the last may be shorter)."""
        step = self.request_bytes
        return [(s // self.block_bytes, s, min(step, n - s)) for s in range(0, n, step)]

    def _crcs(self, arr: np.ndarray) -> list[int]:
        """CRC32C of each ``block_bytes`` block of ``arr`` (the last may be shorter)."""
        bb = self.block_bytes
        return [checksum.crc(arr[s : s + bb]) for s in range(0, arr.size, bb)]

    def read(
        self, h: FileHandle, arr: np.ndarray, expected: list[int] | None, label: str, compute: bool = True
    ) -> Future:
        """Read ``arr.size`` bytes from the start of ``h`` into ``arr``; verify block CRCs if given.

        With ``compute`` false and no ``expected``, no checksum is computed (results are 0).

        The future resolves to the block CRCs; it fails with ChecksumError naming the file, byte
        offset and ``label`` on a mismatch, or StoreError on an I/O error. Raises ChecksumError at
        once if ``expected`` does not have one checksum per block.
        """
        nblocks = -(-arr.size // self.block_bytes)
        if expected is not None and len(expected) != nblocks:
            raise ChecksumError(f"{h.path}: manifest has {len(expected)} checksums, layout needs {nblocks}")

        def task(first: int, start: int, n: int) -> list[int]:
            t0 = time.thread_time() if self.meter is not None else 0.0
            run = arr[start : start + n]
            try:
                raw = self.files.acquire(h)
                try:
                    self._read_block(raw, h, run, start)
                finally:
                    self.files.release(h)
            except OSError as e:
                raise os_error(e, h.path, "reading") from e
            crcs = self._crcs(run) if expected is not None or compute else [0] * -(-n // self.block_bytes)
            self._charge(h, "read", t0, n)
            if expected is not None:
                for j, c in enumerate(crcs):
                    if c != expected[first + j]:
                        lo = start + j * self.block_bytes
                        hi = min(lo + self.block_bytes, start + n)
                        raise ChecksumError(
                            f"checksum mismatch in {h.path} at bytes {lo}..{hi} ({label}): the file is "
                            "corrupted; restore the run from a checkpoint"
                        )
            return crcs

        return _flat(gather([self._pool.submit(task, *r) for r in self._runs(arr.size)]))

    def write(self, h: FileHandle, arr: np.ndarray, compute: bool = True) -> Future:
        """Write ``arr`` to the start of ``h``; the future resolves to the block CRCs (0 if not ``compute``)."""

        def task(first: int, start: int, n: int) -> list[int]:
            t0 = time.thread_time() if self.meter is not None else 0.0
            run = arr[start : start + n]
            crcs = self._crcs(run) if compute else [0] * -(-n // self.block_bytes)
            try:
                raw = self.files.acquire(h)
                try:
                    self._write_block(raw, h, run, start)
                finally:
                    self.files.release(h)
            except OSError as e:
                raise os_error(e, h.path, "writing") from e
            self._charge(h, "write", t0, n)
            return crcs

        return _flat(gather([self._pool.submit(task, *r) for r in self._runs(arr.size)]))

    def fsync(self, h: FileHandle) -> Future:
        """Flush ``h`` to stable storage on the pool."""

        def task() -> None:
            t0 = time.thread_time() if self.meter is not None else 0.0
            try:
                with self.files.use(h) as raw:
                    self._fsync(raw, h)
            except OSError as e:
                raise os_error(e, h.path, "syncing") from e
            self._charge(h, "fsync", t0, 0)

        return self._pool.submit(task)

    def shutdown(self) -> None:
        """Wait for queued I/O, stop the threads and close every file still open."""
        self._pool.shutdown(wait=True)
        self.files.close_all()
