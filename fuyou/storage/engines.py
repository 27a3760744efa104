"""Choosing the I/O engine: kvikio where a CUDA driver is present, the POSIX pool elsewhere."""

from __future__ import annotations

from fuyou.errors import ConfigError
from fuyou.storage.io_base import IOEngine
from fuyou.storage.io_kvikio import KvikioEngine, kvikio_usable
from fuyou.storage.io_posix import PosixEngine

IO_KINDS = ("auto", "posix", "kvikio")


def make_engine(kind: str = "auto", threads: int = 16, block_bytes: int = 1 << 20) -> IOEngine:
    """Return the I/O engine for ``kind``: ``auto`` picks kvikio if usable, else POSIX.

    Raises ConfigError for an unknown kind, StoreError if kvikio is asked for but unusable.
    """
    if kind not in IO_KINDS:
        raise ConfigError(f"I/O engine must be one of {IO_KINDS}, got {kind!r}")
    if kind == "kvikio" or (kind == "auto" and kvikio_usable()):
        return KvikioEngine(threads, block_bytes)
    return PosixEngine(threads, block_bytes)
