"""Block checksums: CRC32C (hardware-accelerated, GIL released) per I/O block of an extent piece."""

from __future__ import annotations

import base64

import crc32c as _crc32c
import numpy as np


def crc(buf: bytes | memoryview | np.ndarray) -> int:
    """CRC32C of the bytes in ``buf`` (releases the GIL; ~13 GB/s per core with SSE4.2)."""
    # numpy's stubs give ndarray the buffer protocol (__buffer__) only for Python >= 3.12
    return _crc32c.crc32c(buf)  # type: ignore[arg-type]


def encode(crcs: list[int]) -> str:
    """Pack a list of 32-bit checksums into base64 for the manifest."""
    return base64.b64encode(np.asarray(crcs, dtype="<u4").tobytes()).decode("ascii")


def decode(text: str) -> list[int]:
    """Inverse of ``encode``."""
    return np.frombuffer(base64.b64decode(text), dtype="<u4").tolist()
