"""The out-of-core training engine: layer-streamed steps over the SSD store with overlapped CPU Adam.

Modules, in the order a step uses them: ``config`` (``EngineConfig``), ``engine`` (``Engine``: build,
admit the ``Plan`` to the budgets, ``train_step``, ``export``), ``step`` (one step: forward,
turnaround, backward, over a typed ``StepContext``, returning a ``StepResult``), ``activations`` (what a
block keeps for backward, per policy), ``turnaround`` (the head's forward, loss and backward: whole, or
split by vocabulary rows with ``vocab_loss``), ``updates`` (what completed gradients become: update in
backward, clipping with updates overlapping the next forward, or LoRA adapters — one class each,
chosen at assembly), ``adam_stage`` (state store → host → CPU AdamW → store, chained on futures),
``lora`` (the adapters), ``balance`` (a mixture of experts' balance loss), ``export`` (HF safetensors
out of the store). The rules the
step follows are ``fuyou.schedule``; the data moves are ``fuyou.transfer``.

Names are imported lazily, so ``fuyou.engine.Plan`` (``fuyou.schedule.Plan``) does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Engine": "fuyou.engine.engine",
    "EngineConfig": "fuyou.engine.config",
    "Plan": "fuyou.schedule.plan",
    "StepResult": "fuyou.engine.step",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import ``name`` from its submodule on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fuyou.engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
