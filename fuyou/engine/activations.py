"""What a block keeps from forward for backward, per activation policy.

* ``keep`` — the autograd graph stays on the device.
* ``swap_cpu`` — the graph stays, but every saved tensor that is not a weight moves to host memory
  at pack time and back at unpack (saved-tensor hooks). Weights are recognised by their storage
  and left alone: their storage is freed after forward and refilled before backward.
* ``swap_ssd`` — like ``swap_cpu``, then written to a scratch file on the SSD and read back a block
  ahead of its backward (``fuyou.transfer.activation_files``).
* ``recompute`` — only the block input (and the RNG state, for dropout) is kept; backward re-runs
  the forward with gradients enabled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fuyou.device.base import Backend
from fuyou.models.adapters import Adapter, MicroBatchContext
from fuyou.transfer.activation_files import ActivationSpace, SSDRecord
from fuyou.transfer.host_pool import HostBufferPool


@dataclass
class Saved:
    """What one (block, micro-batch) forward left for its backward."""

    policy: str
    x: torch.Tensor
    y: torch.Tensor | None
    ctx: MicroBatchContext | None
    rng: Any = None
    swap: _Swap | None = None

    def release(self) -> None:
        """Return swapped bytes to the host budget (after backward)."""
        if self.swap is not None:
            self.swap.release()


class _Swap:
    """Saved-tensor hooks that move non-weight tensors to host memory (swap_cpu) or on to SSD (swap_ssd)."""

    def __init__(self, weight_storages: set[int], pool: HostBufferPool, record: SSDRecord | None) -> None:
        self.weights, self.pool, self.record, self.charged = weight_storages, pool, record, 0

    def pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() in self.weights or t.numel() == 0:
            return t
        if self.record is not None:
            return self.record.pack(t)
        n = t.numel() * t.element_size()
        self.pool.charge(n, "activations swapped to host memory")
        self.charged += n
        return t.device, t.to("cpu", copy=True)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, int):
            assert self.record is not None  # pack() gives ints only into an SSD record
            return self.record.unpack(packed)
        device, t = packed
        return t.to(device, non_blocking=True)

    def release(self) -> None:
        if self.record is not None:
            self.record.release()
        self.pool.refund(self.charged)
        self.charged = 0


def _input(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    return x.requires_grad_() if x.is_floating_point() else x


def forward(
    adapter: Adapter,
    b: int,
    x: torch.Tensor,
    ctx: MicroBatchContext | None,
    policy: str,
    backend: Backend,
    weights: list[torch.Tensor],
    space: ActivationSpace,
    k: int = 0,
) -> tuple[torch.Tensor, MicroBatchContext | None, Saved]:
    """Run block ``b`` forward (micro-batch ``k``) under ``policy``; return (output, context, what backward needs)."""
    if policy == "recompute":
        rng = backend.rng_state()
        with torch.no_grad():
            y, ctx2 = adapter.forward(b, x, ctx)
        return y, ctx2, Saved(policy, x.detach(), None, ctx, rng)
    x_in = _input(x)
    with torch.enable_grad():
        if policy in ("swap_cpu", "swap_ssd"):
            record = SSDRecord(space, b, k) if policy == "swap_ssd" else None
            hooks = _Swap({w.untyped_storage().data_ptr() for w in weights}, space.pool, record)
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                y, ctx2 = adapter.forward(b, x_in, ctx)
            if record is not None:
                record.flush()
            return y.detach(), ctx2, Saved(policy, x_in, y, ctx, swap=hooks)
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
    assert y is not None  # kept by forward, or recomputed just now
    torch.autograd.backward(y, dy)
    saved.release()
    return x_in.grad if x_in.requires_grad else None


def prefetch(saved: list[Saved]) -> None:
    """Start reading a block's SSD-swapped activations back (before its backward)."""
    for s in saved:
        if s.swap is not None and s.swap.record is not None:
            s.swap.record.prefetch()
