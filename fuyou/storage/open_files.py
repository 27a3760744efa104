"""A bounded cache of open files: the store's open descriptors stay few whatever the model size.

A store keeps two versions of every extent piece as files (~1.7k files for a 7B model), more than
many machines allow one process to hold open (``ulimit -n`` is often 1024). A backend therefore
opens a file when an I/O task needs it and keeps at most ``capacity`` of them open, closing the
least recently used one beyond that. A file in use by an I/O task is *pinned*: it is never closed
under the task; if every open file is pinned, the cache grows past ``capacity`` by at most the
number of concurrent tasks (the backend's threads) and shrinks again as they finish.

A handle names its file by path; whoever renames the file updates ``FileHandle.path`` while no I/O
on it is in flight (the store renames only spare files). An open descriptor survives the rename.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fuyou.errors import StoreError

DEFAULT_MAX_FILES = 4096
"""Most files one backend keeps open when the open-file limit allows it."""
LIMIT_SHARE = 4
"""A backend keeps open at most 1/LIMIT_SHARE of the process's soft open-file limit."""


class FileHandle:
    """A file of the store: its path and whether it uses O_DIRECT; the backend opens it on demand.

    ``stage`` names what the file holds for CPU accounting (``cpu_meter``): the store sets
    ``weights``/``state``; None means "from the path" (``cpu_meter.stage_of_path``).
    """

    def __init__(self, path: str, direct: bool, stage: str | None = None) -> None:
        self.path = path
        self.direct = direct
        self.stage = stage
        self.closed = False

    def __repr__(self) -> str:
        return f"FileHandle({self.path!r}, direct={self.direct}{', closed' if self.closed else ''})"


class _Entry:
    __slots__ = ("raw", "pins")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.pins = 0


def default_capacity(threads: int, fds_per_file: int = 1) -> int:
    """Files a backend may keep open: 1/4 of the soft ``RLIMIT_NOFILE`` (in descriptors, each file
    taking ``fds_per_file``), at most 4096 files, at least ``threads + 4`` (every I/O thread can pin
    one file, plus a few spare)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = DEFAULT_MAX_FILES * LIMIT_SHARE * fds_per_file
    except (ImportError, OSError, ValueError):
        soft = 1024
    return max(threads + 4, min(DEFAULT_MAX_FILES, soft // LIMIT_SHARE // fds_per_file))


class OpenFiles:
    """LRU cache of open files keyed by ``FileHandle``; thread-safe (see the module docstring).

    ``opener(path, direct)`` opens a file (raising OSError on failure), ``closer(raw)`` closes what
    it returned; both run outside the cache's lock.
    """

    def __init__(self, opener: Callable[[str, bool], Any], closer: Callable[[Any], None], capacity: int) -> None:
        if capacity < 1:
            raise StoreError(f"the open-file cache needs a capacity of at least 1 file, got {capacity}")
        self.capacity = capacity
        self._opener, self._closer = opener, closer
        self._lock = threading.Lock()
        self._open: OrderedDict[FileHandle, _Entry] = OrderedDict()
        self.opens = 0
        """Files opened so far (a measure of cache misses)."""

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    @contextmanager
    def use(self, h: FileHandle) -> Iterator[Any]:
        """Pin ``h``'s open file (opening it if needed) for the ``with`` block; yields the raw handle.

        Raises StoreError if ``h`` was closed, OSError if opening the file fails.
        """
        raw = self.acquire(h)
        try:
            yield raw
        finally:
            self.release(h)

    def forget(self, h: FileHandle) -> None:
        """Mark ``h`` closed and close its file now, or when its last user unpins it."""
        with self._lock:
            h.closed = True
            e = self._open.get(h)
            if e is None or e.pins:
                return
            del self._open[h]
        self._closer(e.raw)

    def close_all(self) -> None:
        """Close every unpinned open file (the handles stay usable: they reopen on demand)."""
        with self._lock:
            victims = [k for k, e in self._open.items() if not e.pins]
            raws = [self._open.pop(k).raw for k in victims]
        self._close(raws)

    def acquire(self, h: FileHandle) -> Any:
        """Pin ``h``'s open file (opening it if needed) and return its raw handle; every ``acquire``
        needs one ``release`` (``use`` pairs them; I/O tasks call both directly, which is cheaper).

        Raises StoreError if ``h`` was closed, OSError if opening the file fails.
        """
        with self._lock:
            if h.closed:
                raise StoreError(f"I/O on {h.path} after its file was closed")
            e = self._open.get(h)
            if e is not None:
                self._open.move_to_end(h)
                e.pins += 1
                return e.raw
        raw = self._opener(h.path, h.direct)  # outside the lock: a slow open must not stall other files
        extra: list[Any] = []
        with self._lock:
            self.opens += 1
            e = None if h.closed else self._open.get(h)
            if h.closed or e is not None:
                extra.append(raw)  # closed meanwhile, or another thread opened it first: drop ours
            else:
                e = self._open[h] = _Entry(raw)
            if e is not None:
                e.pins += 1
                self._open.move_to_end(h)
                extra += self._evict()
        try:
            self._close(extra)
        except BaseException:
            if e is not None:
                self.release(h)  # the caller gets an error, not a pinned file: leave nothing pinned
            raise
        if e is None:
            raise StoreError(f"I/O on {h.path} after its file was closed")
        return e.raw

    def release(self, h: FileHandle) -> None:
        """Unpin ``h``; close files beyond capacity (and ``h``'s, if it was closed meanwhile)."""
        with self._lock:
            e = self._open[h]
            e.pins -= 1
            if len(self._open) <= self.capacity and not h.closed:
                return  # the common case: nothing to close
            victims = self._evict()
            if h.closed and not e.pins:
                del self._open[h]
                victims.append(e.raw)
        self._close(victims)

    def _evict(self) -> list[Any]:
        """Take the least recently used unpinned files beyond capacity out of the cache; return their raw
        handles for closing outside the lock (caller holds the lock)."""
        over = len(self._open) - self.capacity
        if over <= 0:
            return []
        doomed = []
        for k, e in self._open.items():
            if not e.pins:
                doomed.append(k)
                if len(doomed) == over:
                    break
        return [self._open.pop(k).raw for k in doomed]

    def _close(self, raws: list[Any]) -> None:
        errors = []
        for raw in raws:
            try:
                self._closer(raw)
            except OSError as err:  # keep closing the others; report the first
                errors.append(err)
        if errors:
            raise errors[0]
