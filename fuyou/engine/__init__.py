"""The out-of-core training engine: layer-streamed steps over the SSD store with overlapped CPU Adam."""

from fuyou.engine.config import EngineConfig
from fuyou.engine.engine import Engine
from fuyou.engine.plan import Plan

__all__ = ["Engine", "EngineConfig", "Plan"]
