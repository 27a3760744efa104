"""``fuyou.engine.plan.Plan`` without importing the engine package (and torch with it).

``fuyou/engine/__init__.py`` imports the whole engine (torch, transformers), so ``from
fuyou.engine.plan import Plan`` costs seconds. ``plan.py`` itself is plain data: it is loaded here
from its file under its own module name, so a later ``import fuyou.engine`` reuses the very same
module and ``Plan`` class (the engine sees the planner's plans as its own). Once the engine package
imports lazily, this file can become ``from fuyou.engine.plan import Plan``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_NAME = "fuyou.engine.plan"


def _load() -> object:
    if _NAME in sys.modules or "fuyou.engine" in sys.modules:
        import fuyou.engine.plan as mod

        return mod
    import fuyou

    path = os.path.join(os.path.dirname(fuyou.__file__), "engine", "plan.py")
    spec = importlib.util.spec_from_file_location(_NAME, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = mod
    spec.loader.exec_module(mod)
    return mod


_mod = _load()
Plan = _mod.Plan
POLICIES = _mod.POLICIES
SCHEDULES = _mod.SCHEDULES

__all__ = ["POLICIES", "Plan", "SCHEDULES"]
