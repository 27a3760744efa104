"""Backend selection: ``get_backend("auto" | "cpu" | "cuda", capacity=...)``.

``FUYOU_CPU_ASYNC=1`` (or ``arena``, or ``resize``) makes ``cpu`` the asynchronous CPU backend
(``cpu_async.py``), a test mode: copies run on per-stream worker threads after random delays
(seeded by ``FUYOU_CPU_ASYNC_SEED``), events complete only when their copies have run, and released
memory is poisoned (NaN), so a missing wait on the data path fails on CPU as it would on a GPU.
``resize`` frees and restores device memory by storage resize, as the CUDA backend does.
"""

from __future__ import annotations

import os

from fuyou.device.base import HOST_ALIGN, Backend, Event, MemoryStats, host_aligned_empty
from fuyou.device.cpu import CPUBackend
from fuyou.errors import ConfigError

__all__ = [
    "HOST_ALIGN",
    "Backend",
    "CPUBackend",
    "Event",
    "MemoryStats",
    "device_kind",
    "get_backend",
    "host_aligned_empty",
]


def device_kind(kind: str = "auto") -> str:
    """``cuda`` or ``cpu`` for a ``--device`` value (``auto``: ``cuda`` when torch sees a GPU).

    Raises ConfigError for an unknown ``kind``.
    """
    if kind not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {kind!r}")
    if kind != "auto":
        return kind
    from fuyou.device import cuda  # imports torch.cuda only here

    return "cuda" if cuda.cuda_available() else "cpu"


def get_backend(kind: str = "auto", capacity: int | None = None) -> Backend:
    """Return a backend: ``cuda`` if asked (or ``auto`` and a GPU is visible), else ``cpu``.

    ``capacity`` caps device memory in bytes; under torchrun each rank takes GPU ``LOCAL_RANK`` (on CPU: the fake device's size; default unlimited).
    ``cpu`` is the asynchronous CPU backend when ``FUYOU_CPU_ASYNC`` is set (see the module docstring).
    Raises ConfigError for an unknown ``kind`` (or ``FUYOU_CPU_ASYNC`` value); FuyouError if ``cuda``
    is asked and absent.
    """
    if device_kind(kind) == "cuda":
        from fuyou.device import cuda

        return cuda.CUDABackend(capacity, index=int(os.environ.get("LOCAL_RANK", "0")))  # torchrun: a GPU per rank
    from fuyou.device import cpu_async

    capacity = capacity if capacity is not None else 2**62
    arena = cpu_async.mode()
    if arena is not None:
        return cpu_async.AsyncCPUBackend(capacity, seed=cpu_async.seed(), arena=arena)
    return CPUBackend(capacity)
