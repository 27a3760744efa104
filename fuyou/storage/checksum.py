"""Block checksums: CRC32C (hardware-accelerated, GIL released) per I/O block of an extent piece.

Two implementations give the same CRC32C: the ``crc32c`` package (one chain of the CPU's ``crc32``
instruction, ~6 GB/s per core on a Zen 1 EPYC) and ``crc_fast`` (three interleaved chains: up to
3× that where the instruction issues once per cycle, as on Intel cores and Zen 2 and later; no
faster on Zen 1, where it issues once per 3 cycles). The first checksum of the process times both on
a 1 MiB buffer (a few milliseconds, plus importing numba and, when its on-disk cache is cold,
compiling the kernel: only then, never at import) and keeps the faster; ``FUYOU_CRC=lib`` or
``FUYOU_CRC=fast`` fixes the choice.
"""

from __future__ import annotations

import base64
import os
import threading
import time
from collections.abc import Callable

import crc32c as _crc32c
import numpy as np

from fuyou.errors import ConfigError

CRC_ENV = "FUYOU_CRC"
"""Environment variable fixing the implementation: ``lib``, ``fast`` or ``auto`` (the default)."""

_impl: Callable[[bytes | memoryview | np.ndarray], int] | None = None
_impl_name = ""
_lock = threading.Lock()


def _lib(buf: bytes | memoryview | np.ndarray) -> int:
    # numpy's stubs give ndarray the buffer protocol (__buffer__) only for Python >= 3.12
    return _crc32c.crc32c(buf)  # type: ignore[arg-type]


def _fast(buf: bytes | memoryview | np.ndarray) -> int:
    from fuyou.storage import crc_fast  # imported by ``choose`` already: a dictionary lookup

    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
        return _lib(buf)
    return crc_fast.crc32c(arr)


def _fast_available() -> bool:
    """Whether ``crc_fast`` runs here; imports it (numba, compiled kernels) only when asked."""
    from fuyou.storage import crc_fast

    return crc_fast.available()


def _cpu_seconds(fn: Callable[[np.ndarray], int], sample: np.ndarray, reps: int = 8) -> float:
    """Least thread CPU time of one ``fn(sample)`` over ``reps`` runs."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time_ns()
        fn(sample)
        best = min(best, (time.thread_time_ns() - t0) / 1e9)
    return best


def choose(mode: str | None = None) -> str:
    """Pick the implementation (``lib`` | ``fast`` | ``auto``: the faster here; default ``$FUYOU_CRC``
    or ``auto``) and return its name. ``fast`` falls back to ``lib`` where it cannot run.

    Raises ConfigError for another mode.
    """
    global _impl, _impl_name
    mode = mode or os.environ.get(CRC_ENV, "").strip() or "auto"
    if mode not in ("auto", "lib", "fast"):
        raise ConfigError(f"${CRC_ENV} must be auto, lib or fast, got {mode!r}")
    impl, name = _lib, "lib"
    if mode != "lib" and _fast_available():
        sample = np.frombuffer(np.random.default_rng(0).bytes(1 << 20), dtype=np.uint8)
        ok = _fast(sample) == _lib(sample)  # compiles the kernel, and never trusts a wrong one
        if ok and (mode == "fast" or _cpu_seconds(_fast, sample) < _cpu_seconds(_lib, sample)):
            impl, name = _fast, "fast"
    with _lock:
        _impl, _impl_name = impl, name
    return name


def implementation() -> str:
    """The implementation in use (``lib`` | ``fast``), choosing it now if none was chosen."""
    if _impl is None:
        choose()  # two threads may both choose: harmless, they agree up to timing noise
    return _impl_name


def crc(buf: bytes | memoryview | np.ndarray) -> int:
    """CRC32C of the bytes in ``buf`` (releases the GIL); the implementation is chosen on first use."""
    impl = _impl
    if impl is None:
        implementation()
        impl = _impl
        assert impl is not None
    return impl(buf)


def encode(crcs: list[int]) -> str:
    """Pack a list of 32-bit checksums into base64 for the manifest."""
    return base64.b64encode(np.asarray(crcs, dtype="<u4").tobytes()).decode("ascii")


def decode(text: str) -> list[int]:
    """Inverse of ``encode``."""
    return np.frombuffer(base64.b64decode(text), dtype="<u4").tolist()
