"""Python-file I/O backend: the POSIX pool's block I/O behind Python file objects instead of descriptors.

Raw handles are unbuffered ``io.FileIO`` objects (O_DIRECT when asked) and ``fsync`` goes through
the file's path, as with kvikio's ``CuFile`` handles. Its purpose is coverage: everything above the
backend (the store's commits and retirement of files, checkpoints, resume) must work whatever a
backend's handles are, and this backend checks that on any CPU machine, where kvikio cannot run.
Speed is the POSIX backend's (the same ``preadv``/``pwritev`` calls on the object's descriptor).
Select it with ``io="pyfile"`` (or ``FUYOU_IO=pyfile`` for ``io="auto"``).
"""

from __future__ import annotations

import io
import os
from typing import Any

from fuyou.storage.dirs import fsync_path
from fuyou.storage.io_base import FileHandle
from fuyou.storage.io_posix import PosixIO


class PyFileIO(PosixIO):
    """Block I/O through Python file objects; see the module docstring."""

    name = "pyfile"

    def _open_raw(self, path: str, direct: bool) -> Any:
        """An unbuffered read-write ``io.FileIO`` of ``path`` (O_DIRECT when ``direct``)."""
        extra = os.O_DIRECT if direct else 0
        return io.FileIO(path, "r+", opener=lambda p, flags: os.open(p, flags | extra))

    def _close_raw(self, raw: Any) -> None:
        raw.close()

    def _fd(self, raw: Any) -> int:
        return raw.fileno()

    def _fsync(self, raw: Any, h: FileHandle) -> None:
        """fsync through a fresh descriptor of ``h.path`` (as the kvikio backend does)."""
        fsync_path(h.path)
