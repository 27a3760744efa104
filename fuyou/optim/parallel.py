"""Launching numba parallel kernels from several Python threads, whatever threading layer numba uses.

Fuyou launches two parallel kernels from two threads: the gradient norm (``norm.py``) on the
training thread and AdamW (``adam_numba.py``) on the Adam worker. numba's ``omp`` and ``tbb``
threading layers accept concurrent launches; its fallback layer, ``workqueue`` (picked when neither
OpenMP nor TBB loads, or forced with ``NUMBA_THREADING_LAYER=workqueue``), aborts the whole process
("Terminating: Nested parallel kernel launch detected") when two threads launch at once.

``parallel_launch()`` wraps every launch: under ``workqueue`` it serialises launches with
``KERNEL_LOCK``; under a thread-safe layer it costs a cached flag check and launches run
concurrently. Until numba has chosen its layer (it does so at the first launch), launches take the
lock, so the first launches are safe whatever layer is then chosen.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

import numba

KERNEL_LOCK = threading.Lock()
"""Serialises parallel kernel launches where the threading layer needs it (``workqueue``)."""
UNSAFE_LAYERS = frozenset({"workqueue"})
"""numba threading layers that abort on concurrent launches from different threads."""

_layer: str | None = None
_NO_LOCK = nullcontext()


def threading_layer() -> str | None:
    """The threading layer numba uses, or None before the first parallel launch chose one."""
    global _layer
    if _layer is None:
        try:
            _layer = numba.threading_layer()
        except ValueError:  # "Threading layer is not initialized": no parallel kernel has run yet
            return None
    return _layer


def needs_lock() -> bool:
    """True if parallel launches must be serialised: the layer is ``workqueue`` or not yet chosen."""
    layer = threading_layer()
    return layer is None or layer in UNSAFE_LAYERS


def parallel_launch() -> AbstractContextManager:
    """Context for one parallel kernel launch (``with parallel_launch(): kernel(...)``): ``KERNEL_LOCK``
    when ``needs_lock()``, else a no-op context (about 1 µs either way, no generator)."""
    return KERNEL_LOCK if needs_lock() else _NO_LOCK
