"""Choosing the I/O backend: the POSIX thread pool unless another is asked for by name.

``auto`` is the POSIX pool (O_DIRECT ``preadv``/``pwritev``), or the backend named by the
``FUYOU_IO`` environment variable (how the CLI, which has no flag for it, selects another).
``kvikio`` (RAPIDS file I/O, given host buffers: not GPUDirect Storage) is used only when asked
for explicitly: it is not yet measured faster than the POSIX pool. ``pyfile`` is the POSIX pool
behind Python file objects, the CPU stand-in for kvikio's non-descriptor handles in tests.
"""

from __future__ import annotations

import os

from fuyou.errors import ConfigError
from fuyou.storage.io_base import IOBackend
from fuyou.storage.io_kvikio import KvikioIO
from fuyou.storage.io_posix import PosixIO
from fuyou.storage.io_pyfile import PyFileIO

IO_BACKENDS: dict[str, type[IOBackend]] = {"posix": PosixIO, "pyfile": PyFileIO, "kvikio": KvikioIO}
IO_KINDS = ("auto", *IO_BACKENDS)
IO_ENV = "FUYOU_IO"
"""Environment variable naming the backend ``auto`` stands for (default: posix)."""


def resolve_kind(kind: str = "auto") -> str:
    """The backend name ``kind`` stands for: ``auto`` is ``$FUYOU_IO`` or ``posix``.

    Raises ConfigError for an unknown kind or an unknown ``$FUYOU_IO``.
    """
    if kind not in IO_KINDS:
        raise ConfigError(f"I/O backend must be one of {IO_KINDS}, got {kind!r}")
    if kind != "auto":
        return kind
    env = os.environ.get(IO_ENV, "").strip() or "posix"
    if env not in IO_BACKENDS:
        raise ConfigError(f"${IO_ENV}={env!r}: the I/O backend must be one of {tuple(IO_BACKENDS)}")
    return env


def make_io(
    kind: str = "auto",
    threads: int = 16,
    block_bytes: int = 1 << 20,
    max_open: int | None = None,
    request_bytes: int | None = None,
) -> IOBackend:
    """Return the I/O backend for ``kind`` (see the module docstring) with ``threads`` threads,
    ``block_bytes`` per checksum, at most ``request_bytes`` per system call (default:
    ``io_base.REQUEST_BYTES``) and at most ``max_open`` open files (default: a quarter of ``ulimit -n``).

    Raises ConfigError for an unknown kind, StoreError if kvikio is asked for but unusable.
    """
    return IO_BACKENDS[resolve_kind(kind)](threads, block_bytes, max_open, request_bytes)
