"""What a block keeps from forward for backward, per activation policy.

* ``keep`` — the autograd graph stays on the device.
* ``swap_cpu`` — the graph stays, but every saved tensor that is not a weight moves to host memory
  at pack time and back at unpack (saved-tensor hooks). Weights are recognised by their storage
  and left alone: their storage is freed after forward and refilled before backward.
* ``recompute`` — only the block input (and the RNG state, for dropout) is kept; backward re-runs
  the forward with gradients enabled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fuyou.device.base import Backend
from fuyou.models.adapters import Adapter, MicroBatchContext


@dataclass
class Saved:
    """What one (block, micro-batch) forward left for its backward."""

    policy: str
    x: torch.Tensor
    y: torch.Tensor | None
    ctx: MicroBatchContext | None
    rng: Any = None
    host_bytes: int = 0


class _ToHost:
    """Saved-tensor hooks that park non-weight tensors in host memory."""

    def __init__(self, weight_storages: set[int], host: torch.device) -> None:
        self.weights, self.host, self.nbytes = weight_storages, host, 0

    def pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() in self.weights or t.numel() == 0:
            return t
        self.nbytes += t.numel() * t.element_size()
        return t.device, t.to(self.host, copy=True)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, t = packed
        return t.to(device, non_blocking=True)


def _input(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    return x.requires_grad_() if x.is_floating_point() else x


def forward(adapter: Adapter, b: int, x: torch.Tensor, ctx: MicroBatchContext | None, policy: str,
            backend: Backend, weights: list[torch.Tensor]) -> tuple[torch.Tensor, MicroBatchContext | None, Saved]:
    """Run block ``b`` forward under ``policy``; return (output, context, what backward needs)."""
    if policy == "recompute":
        rng = backend.rng_state()
        with torch.no_grad():
            y, ctx2 = adapter.forward(b, x, ctx)
        return y, ctx2, Saved(policy, x.detach(), None, ctx, rng)
    x_in = _input(x)
    with torch.enable_grad():
        if policy == "swap_cpu":
            hooks = _ToHost({w.untyped_storage().data_ptr() for w in weights}, torch.device("cpu"))
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                y, ctx2 = adapter.forward(b, x_in, ctx)
            return y.detach(), ctx2, Saved(policy, x_in, y, ctx, host_bytes=hooks.nbytes)
        y, ctx2 = adapter.forward(b, x_in, ctx)
    return y.detach(), ctx2, Saved(policy, x_in, y, ctx)


def backward(adapter: Adapter, b: int, saved: Saved, dy: torch.Tensor, backend: Backend) -> torch.Tensor | None:
    """Backward of block ``b`` for one micro-batch; gradients accumulate into the bound params' ``.grad``.

    Returns the gradient of the block input (None for token ids).
    """
    x_in, y = saved.x, saved.y
    if saved.policy == "recompute":
        x_in = _input(saved.x)
        state = backend.rng_state()
        backend.set_rng_state(saved.rng)
        with torch.enable_grad():
            y, _ = adapter.forward(b, x_in, saved.ctx)
        backend.set_rng_state(state)
    torch.autograd.backward(y, dy)
    return x_in.grad if x_in.requires_grad else None
