"""Backend selection: ``get_backend("auto" | "cpu" | "cuda", capacity=...)``."""

from __future__ import annotations

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

    ``capacity`` caps device memory in bytes (on CPU: the fake device's size; default unlimited).
    Raises ConfigError for an unknown ``kind``; FuyouError if ``cuda`` is asked and absent.
    """
    if device_kind(kind) == "cuda":
        from fuyou.device import cuda

        return cuda.CUDABackend(capacity)
    return CPUBackend(capacity if capacity is not None else 2**62)
