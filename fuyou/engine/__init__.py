"""The out-of-core training engine: layer-streamed steps over the SSD store with overlapped CPU Adam.

Names are imported lazily, so ``fuyou.engine.Plan`` (plain data from ``fuyou.schedule``, used by the
planner) does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {"Engine": "fuyou.engine.engine", "EngineConfig": "fuyou.engine.config", "Plan": "fuyou.schedule.plan"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import ``name`` from its submodule on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fuyou.engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
