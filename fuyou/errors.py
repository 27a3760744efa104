"""One error hierarchy for everything Fuyou reports to a user.

Each error's message is one line that says what is wrong, names the path or value, and gives a
hint for the fix. The CLI prints ``str(err)`` without a traceback.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator


class FuyouError(Exception):
    """Base class of every error Fuyou raises on purpose."""


class ConfigError(FuyouError, ValueError):
    """A configuration value is invalid (bad flag, bad size string, inconsistent options)."""


class DeviceMemoryError(FuyouError, MemoryError):
    """An allocation would exceed the device-memory capacity or budget."""


class HostMemoryError(FuyouError, MemoryError):
    """An allocation would exceed the host-memory (pinned buffer) budget."""


class StoreError(FuyouError):
    """Base class of SSD tensor-store errors."""


class StoreDirError(StoreError):
    """A store directory is missing, not a directory, unwritable, or belongs to another store."""


class StoreSpaceError(StoreError):
    """Not enough free space for the layout, or the disk filled up during a write."""


class DirectIOError(StoreError):
    """O_DIRECT was required (``direct='on'``) but the filesystem refuses it."""


class ChecksumError(StoreError):
    """Data read back from the store does not match the checksum written with it."""


class ManifestError(StoreError):
    """The store manifest is missing, unreadable, or inconsistent with the files on disk."""


class SystemLimitError(FuyouError):
    """An operating-system limit (open files, kernel memory) stopped an operation; the data is fine.

    Deliberately not a StoreError or OSError: code that treats those as "this file or checkpoint is
    damaged" (and falls back to an older one) must not swallow it.
    """


class FuyouWarning(UserWarning):
    """Something works, but slower or less safely than asked (e.g. O_DIRECT fell back to buffered)."""


_ERRNO_IN_TEXT = re.compile(r"(?:os error|errno) ?(\d+)", re.IGNORECASE)
_ERRNO_WORDS = (("too many open files in system", errno.ENFILE), ("too many open files", errno.EMFILE))


def exception_chain(e: BaseException, suppressed: bool = True) -> Iterator[BaseException]:
    """``e``, then its cause (or context) and theirs, each once. ``suppressed=False`` stops at a
    context hidden by ``raise … from None``."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        if cur.__cause__ is not None:
            cur = cur.__cause__
        else:
            cur = None if (cur.__suppress_context__ and not suppressed) else cur.__context__


def error_number(e: BaseException) -> int | None:
    """The errno behind ``e``: its own, its cause's, or one quoted in its text ("os error 24")."""
    for cur in exception_chain(e):
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur.errno
        text = str(cur)
        m = _ERRNO_IN_TEXT.search(text)
        if m:
            return int(m.group(1))
        for words, code in _ERRNO_WORDS:
            if words in text.lower():
                return code
    return None


def _open_file_limit() -> tuple[str, str]:
    """(what the open-file limit is, the command that raises it)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return "its open-file limit", "ulimit -n 65536"
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
        return f"its open-file limit ({soft})", f"ulimit -n {target}"
    return (
        f"its open-file limit ({soft}, also the hard limit)",
        "ulimit -n 65536, as root or after raising the hard limit (nofile in /etc/security/limits.conf)",
    )


def _probe_open(path: str) -> int | None:
    """The errno of opening ``path`` read-only now, or None if that works (or it does not exist)."""
    import os

    if not os.path.exists(path):
        return None
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as err:
        return err.errno
    return None


def os_limit_error(e: BaseException, action: str, probe: str | None = None) -> SystemLimitError | None:
    """If ``e`` comes from an operating-system resource limit, the error naming it and its fix.

    ``action`` says what failed, e.g. ``"reading /data/model.safetensors"``. Recognised: EMFILE
    (this process's open-file limit), ENFILE (the system-wide file table) and ENOMEM (kernel or
    memory-map limits), from the exception, its causes or its text. Libraries that hide the errno
    (safetensors reports EMFILE as "No such file or directory") are seen through with ``probe``: an
    existing file that failed to open is opened once more to learn the real errno. Returns None for
    any other error (the caller reports it as before).
    """
    code = error_number(e)
    if code not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM) and probe is not None:
        code = _probe_open(probe) or code
    if code == errno.EMFILE:
        limit, fix = _open_file_limit()
        return SystemLimitError(
            f"{action} failed: the process reached {limit}, not a problem with the file; "
            f"raise the open-file limit: {fix}"
        )
    if code == errno.ENFILE:
        return SystemLimitError(
            f"{action} failed: the system-wide open-file table is full (ENFILE), not a problem with the file; "
            "close other programs or raise the limit: sysctl -w fs.file-max=1048576"
        )
    if code == errno.ENOMEM:
        return SystemLimitError(
            f"{action} failed: the operating system is out of memory (ENOMEM), not a problem with the file; "
            "free host memory, lower --cpu-memory, or raise the memory-map limit: sysctl -w vm.max_map_count=1048576"
        )
    return None
