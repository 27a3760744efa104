"""Checks and file operations on the store's directories (one per SSD).

Everything here fails early with one clear line naming the path and the fix: a missing or
unwritable directory, too little free space for the layout, O_DIRECT refused when it was required.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import warnings

from fuyou.errors import DirectIOError, FuyouWarning, StoreDirError, StoreSpaceError, os_limit_error
from fuyou.units import format_size

DIRECT_MODES = ("auto", "on", "off")


def _file_above(path: str) -> str | None:
    """The nearest existing ancestor of the absolute ``path`` if it is not a directory (a plain file), else None."""
    parent = os.path.dirname(path)
    while parent != path and not os.path.exists(parent):
        path, parent = parent, os.path.dirname(parent)
    return parent if os.path.exists(parent) and not os.path.isdir(parent) else None


def check_dir(path: str) -> str:
    """Return the absolute path of an existing, writable directory.

    Raises StoreDirError if it is missing, not a directory, or cannot be written (a probe file is
    created and removed, which also catches read-only mounts for root); SystemLimitError if an OS
    limit (open files) stops the probe.
    """
    path = os.path.abspath(path)
    if not os.path.exists(path):
        blocker = _file_above(path)
        if blocker:
            raise StoreDirError(
                f"SSD directory {path} cannot exist: {blocker} is a file, not a directory; pass a directory with --ssd"
            )
        raise StoreDirError(f"SSD directory {path} does not exist; create it (mkdir -p {path}) or pass another --ssd")
    if not os.path.isdir(path):
        raise StoreDirError(f"SSD directory {path} is not a directory; pass a directory with --ssd")
    probe = os.path.join(path, f".fuyou-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise (
            os_limit_error(e, f"checking SSD directory {path}")
            or StoreDirError(
                f"SSD directory {path} is not writable ({e.strerror}); fix its permissions or mount, or pass another --ssd"
            )
        ) from e
    return path


def direct_supported(path: str) -> bool:
    """True if an aligned 4 KiB O_DIRECT write works in directory ``path``."""
    probe = os.path.join(path, f".fuyou-odirect-{os.getpid()}")
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
        try:
            os.pwritev(fd, [buf], 0)
        finally:
            os.close(fd)
        return True
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return False
        raise (
            os_limit_error(e, f"probing O_DIRECT in {path}")
            or StoreDirError(f"cannot probe O_DIRECT in {path}: {e.strerror}")
        ) from e
    finally:
        buf.close()
        if os.path.exists(probe):
            os.unlink(probe)


def resolve_direct(mode: str, path: str) -> bool:
    """Decide O_DIRECT for ``path`` under mode ``auto`` | ``on`` | ``off``.

    ``auto`` uses O_DIRECT where it works and warns (FuyouWarning) where it falls back to
    buffered I/O; ``on`` raises DirectIOError where it does not work.
    """
    if mode not in DIRECT_MODES:
        raise DirectIOError(f"direct I/O mode must be one of {DIRECT_MODES}, got {mode!r}")
    if mode == "off":
        return False
    if direct_supported(path):
        return True
    if mode == "on":
        raise DirectIOError(
            f"the filesystem of {path} refuses O_DIRECT; put the store on an SSD filesystem (ext4, xfs) "
            "or allow buffered I/O (direct='auto' or 'off')"
        )
    warnings.warn(
        f"O_DIRECT is not supported in {path}; using buffered I/O (page cache will use RAM, timings less exact)",
        FuyouWarning,
        stacklevel=3,
    )
    return False


def check_space(path: str, need: int, what: str) -> None:
    """Raise StoreSpaceError if ``path``'s filesystem has fewer than ``need`` free bytes.

    Filesystems that report no size at all (ramfs) are not checked.
    """
    usage = shutil.disk_usage(path)
    free = usage.free
    if usage.total and need > free:
        raise StoreSpaceError(
            f"not enough free space in {path}: {what} needs {format_size(need)}, {format_size(free)} free; "
            "free space or add another --ssd directory to stripe across"
        )


def preallocate(path: str, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` allocated (posix_fallocate; ftruncate where unsupported).

    Raises StoreSpaceError when the disk is full, SystemLimitError if an OS limit (open files) stops
    it, StoreDirError on other failures; no partial file is left behind on failure.
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    except OSError as e:
        raise (os_limit_error(e, f"creating {path}") or StoreDirError(f"cannot create {path}: {e.strerror}")) from e
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                raise
            os.ftruncate(fd, nbytes)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreSpaceError(
                f"disk full: cannot allocate {format_size(nbytes)} for {path}; free space or add another --ssd directory"
            ) from e
        raise (os_limit_error(e, f"allocating {path}") or StoreDirError(f"cannot allocate {path}: {e.strerror}")) from e
    os.close(fd)


def fsync_path(path: str, flags: int = 0) -> None:
    """fsync the file (or, with ``os.O_DIRECTORY``, the directory) at ``path`` through a fresh descriptor
    (backends whose handles are not descriptors sync this way). Raises OSError on failure."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync a directory so renames and new entries in it are durable.

    Raises SystemLimitError if an OS limit (open files) stops it, OSError on other failures.
    """
    try:
        fsync_path(path, os.O_DIRECTORY)
    except OSError as e:
        limit = os_limit_error(e, f"syncing directory {path}")
        if limit is not None:
            raise limit from e
        raise


RANK_FIELDS = ("{rank}", "{local_rank}")
"""Placeholders in a store path that each data-parallel rank fills in."""


def rank_template(dirs: tuple[str, ...] | list[str], world: int) -> tuple[str, ...]:
    """``dirs`` as a per-rank template: with several ranks, a path without ``{rank}``/``{local_rank}``
    gets a ``rank{rank}`` subdirectory (what ``rank_dirs`` would give it); one rank: unchanged."""
    if world == 1:
        return tuple(dirs)
    return tuple(d if any(f in d for f in RANK_FIELDS) else os.path.join(d, "rank{rank}") for d in dirs)


def rank_dirs(dirs: tuple[str, ...] | list[str], rank: int, world: int, local_rank: int | None = None) -> list[str]:
    """The store directories of data-parallel rank ``rank`` of ``world``: ``{rank}`` and
    ``{local_rank}`` (default: ``LOCAL_RANK``, else ``rank``) filled in; with several ranks a path
    without either gets a ``rank<r>`` subdirectory (created when the path is a directory), so ranks
    never share a store."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank)) if world > 1 else rank
    out = []
    for d in dirs:
        if any(f in d for f in RANK_FIELDS):
            out.append(d.replace("{rank}", str(rank)).replace("{local_rank}", str(local_rank)))
        elif world == 1:
            out.append(d)
        else:
            out.append(os.path.join(d, f"rank{rank}"))
            if os.path.isdir(d):
                os.makedirs(out[-1], exist_ok=True)
    return out
