"""What a block keeps from forward for backward, per activation policy.

* ``keep`` — the autograd graph stays on the device.
* ``swap_cpu`` — the graph stays, but every saved tensor that is not a weight moves to host memory
  at pack time and back at unpack (saved-tensor hooks), on the copy streams
  (``fuyou.transfer.activation_copies``): off the device without the training thread waiting, back
  one micro-batch ahead of its backward (``upload``). Weights are recognised by their storage and
  left alone: their storage is freed after forward and refilled before backward.
* ``swap_ssd`` — like ``swap_cpu``, then written to a scratch file on the SSD and read back a block
  ahead of its backward (``fuyou.transfer.activation_files``).
* ``recompute`` — only the block input (and the RNG state, for dropout) is kept; backward re-runs
  the forward with gradients enabled.
* ``recompute_cpu`` — ``recompute`` with the block input in host memory: copied off the device
  after forward and back one micro-batch ahead of its backward, on the copy streams (for long
  sequences the inputs of every block, kept for the whole step, are what fills the device).

A mixture-of-experts layer split into expert groups (``Adapter.slices``) is a core block followed by
``additive`` group blocks. The core leaves its ``Route`` (normalised hidden states, expert indices,
routing weights) in the micro-batch context, detached into leaves; each group adds its experts'
output to the stream, so its backward needs no input and passes ``dy`` on unchanged, while
accumulating the leaves' gradients. The core's backward then seeds its own graph (kept or recomputed)
with them: ``torch.autograd.backward([y, hn, w], [dy, hn.grad, w.grad])``. The route's ``hn`` (one
``tokens × hidden`` tensor per split layer and micro-batch) stays on the device from the core's
forward to its backward, unless the layer's last group is ``recompute_cpu``: then it waits in host
memory like a block input, from that group's forward until its backward (the first of the layer's),
which makes it a leaf again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from fuyou.device.base import Backend
from fuyou.engine.balance import StepBalance, prob_sums
from fuyou.models.adapters import Adapter, MicroBatchContext, Route
from fuyou.schedule.plan import RECOMPUTES
from fuyou.transfer.activation_copies import ActivationCopies, HostCopy
from fuyou.transfer.activation_files import ActivationSpace, SSDRecord
from fuyou.transfer.host_pool import HostBufferPool

_T = TypeVar("_T")


@dataclass
class Saved:
    """What one (block, micro-batch) forward left for its backward."""

    policy: str
    x: torch.Tensor | None
    """The block input on the device (None: ``offloaded``)."""
    y: torch.Tensor | None
    ctx: MicroBatchContext | None
    rng: Any = None
    swap: _Swap | None = None
    offloaded: _Offloaded | None = None
    """recompute_cpu: the block input in host memory."""
    router: torch.Tensor | None = None
    """A mixture of experts' router probability sums, in the graph (``fuyou.engine.balance``; graph
    policies only: recompute policies recompute them)."""
    route: Route | None = None
    """The core of a split mixture-of-experts layer: its ``Route`` as its graph computed it (graph
    policies; recompute policies recompute it)."""
    parked_route: tuple[int, torch.Tensor, torch.Tensor] | None = None
    """The last expert group of a layer under ``recompute_cpu``: (layer, expert indices, routing
    weights) of the route whose ``hn`` is ``offloaded``."""

    def release(self) -> None:
        """Return swapped bytes to the host budget (after backward)."""
        for part in (self.swap, self.offloaded):
            if part is not None:
                part.release()

    def input(self) -> torch.Tensor:
        """The block input on the device (recompute_cpu: copied back now, if ``upload`` did not start it)."""
        if self.offloaded is not None:
            return self.offloaded.take()
        assert self.x is not None  # kept on the device unless offloaded
        return self.x


class _Offloaded:
    """A recompute block's input in host memory (recompute_cpu), charged to the host budget."""

    def __init__(self, x: torch.Tensor, space: ActivationSpace, what: str) -> None:
        self.nbytes = x.numel() * x.element_size()
        space.pool.charge(self.nbytes, "block inputs offloaded to host memory")
        self.space, self.what = space, what
        self.copy: HostCopy | None = space.copies.off(x, what)

    def upload(self) -> None:
        """Start copying the input back onto the device."""
        assert self.copy is not None  # not released before its backward
        self.space.copies.upload(self.copy, self.what)

    def take(self) -> torch.Tensor:
        """The input back on the device (for compute)."""
        assert self.copy is not None  # not released before its backward
        return self.space.copies.take(self.copy, self.what)

    def release(self) -> None:
        """Drop the host copy and return its bytes to the host budget."""
        if self.copy is not None:
            self.copy = None
            self.space.pool.refund(self.nbytes)


class _Swap:
    """Saved-tensor hooks that move non-weight tensors to host memory (swap_cpu) or on to SSD (swap_ssd)."""

    def __init__(
        self,
        weight_storages: set[int],
        pool: HostBufferPool,
        record: SSDRecord | None,
        copies: ActivationCopies,
        what: str,
    ) -> None:
        self.weights, self.pool, self.record, self.charged = weight_storages, pool, record, 0
        self.copies, self.what = copies, what
        self.packed: list[HostCopy] = []
        self._seen: dict[tuple, tuple[weakref.ref, Any]] = {}
        """A saved tensor's (address, offset, shape, strides, dtype) → (its storage, what ``pack`` made of
        it): a tensor autograd saves several times (a norm's output feeding the q, k and v projections)
        moves once. The storage is checked: memory freed and reused at the same address is new data."""
        self._back: dict[int, weakref.ref[torch.Tensor]] = {}
        """``id`` of a packed copy → the device tensor ``unpack`` made of it, while it lives."""

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() in self.weights or t.numel() == 0:
            return t
        key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is storage:  # the same tensor again (not new memory at its address)
            return seen[1]
        if self.record is not None:
            packed: Any = self.record.pack(t)
        else:
            n = t.numel() * t.element_size()
            self.pool.charge(n, "activations swapped to host memory")
            self.charged += n
            self.packed.append(self.copies.off(t, self.what))
            packed = self.packed[-1]
        self._seen[key] = (weakref.ref(storage), packed)
        return packed

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        ref = self._back.get(id(packed))
        t = ref() if ref is not None else None
        if t is None:
            if isinstance(packed, int):
                assert self.record is not None  # pack() gives ints only into an SSD record
                t = self.record.unpack(packed)
            else:
                t = self.copies.take(packed, self.what)
            self._back[id(packed)] = weakref.ref(t)
        return t

    def upload(self) -> None:
        """Start copying the swapped tensors back onto the device (before backward; swap_ssd: once
        read back)."""
        if self.record is not None:
            self.record.upload()
        for c in self.packed:
            self.copies.upload(c, self.what)

    def release(self) -> None:
        self.packed.clear()
        self._seen.clear()
        self._back.clear()
        if self.record is not None:
            self.record.release()
        self.pool.refund(self.charged)
        self.charged = 0


def _input(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    return x.requires_grad_() if x.is_floating_point() else x


def _run(
    adapter: Adapter, b: int, x: torch.Tensor, ctx: MicroBatchContext | None, balance: StepBalance | None, k: int
) -> tuple[torch.Tensor, MicroBatchContext | None, torch.Tensor | None]:
    """The block's forward; with ``balance``, its routers' choices counted and their probability sums."""
    if balance is None:
        return (*adapter.forward(b, x, ctx), None)
    with adapter.routes() as routed:
        y, ctx2 = adapter.forward(b, x, ctx)
    return y, ctx2, balance.observe(k, routed)


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
    balance: StepBalance | None = None,
) -> tuple[torch.Tensor, MicroBatchContext | None, Saved]:
    """Run block ``b`` forward (micro-batch ``k``) under ``policy``; return (output, context, what
    backward needs). With ``balance`` (a mixture of experts' balance loss) the routers are counted."""
    if adapter.additive(b):
        return _forward_additive(adapter, b, x, ctx, policy, backend, weights, space, k)
    y, ctx2, saved = _forward(adapter, b, x, ctx, policy, backend, weights, space, k, balance)
    layer = adapter.route_of(b)
    if layer is not None:  # the groups after this core train against leaves of its route
        assert ctx2 is not None  # made by the embedding block
        graph = ctx2.routes[layer]
        saved.route = graph if policy not in RECOMPUTES else None
        ctx2.routes[layer] = Route(graph.hn.detach().requires_grad_(), graph.idx, graph.w.detach().requires_grad_())
    return y, ctx2, saved


def _forward_additive(
    adapter: Adapter,
    b: int,
    x: torch.Tensor,
    ctx: MicroBatchContext | None,
    policy: str,
    backend: Backend,
    weights: list[torch.Tensor],
    space: ActivationSpace,
    k: int,
) -> tuple[torch.Tensor, MicroBatchContext | None, Saved]:
    """Forward of an ``additive`` block (an expert group): output = input + ``adapter.delta``. Only
    the delta's graph is kept (graph policies), nothing for recompute policies: not the input."""
    assert ctx is not None  # made by the embedding block
    if policy in RECOMPUTES:
        rng = backend.rng_state()
        with torch.no_grad():
            delta = adapter.delta(b, ctx)
        saved = Saved(policy, None, None, ctx, rng)
        layer = adapter.last_of_layer(b)
        if policy == "recompute_cpu" and layer is not None:  # the route waits in host memory
            route = ctx.routes.pop(layer)
            saved.offloaded = _Offloaded(route.hn.detach(), space, f"route of layer {layer}")
            saved.parked_route = (layer, route.idx, route.w)
        return x + delta.view(x.shape).to(x.dtype), ctx, saved
    delta, hooks = _graph(policy, b, k, weights, space, lambda: adapter.delta(b, ctx))
    return x + delta.detach().view(x.shape).to(x.dtype), ctx, Saved(policy, None, delta, ctx, swap=hooks)


def _graph(
    policy: str, b: int, k: int, weights: list[torch.Tensor], space: ActivationSpace, run: Callable[[], _T]
) -> tuple[_T, _Swap | None]:
    """``run()`` with autograd on, the tensors its graph saves moved off the device per ``policy``
    (``swap_cpu``, ``swap_ssd``: the hooks that did it; else kept, None). ``weights``: the block's
    weight buffers, whose views stay."""
    with torch.enable_grad():
        if policy not in ("swap_cpu", "swap_ssd"):
            return run(), None
        record = SSDRecord(space, b, k) if policy == "swap_ssd" else None
        storages = {w.untyped_storage().data_ptr() for w in weights}
        hooks = _Swap(storages, space.pool, record, space.copies, f"activations of block {b}")
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            out = run()
        if record is not None:
            record.flush()
        return out, hooks


def _forward(
    adapter: Adapter,
    b: int,
    x: torch.Tensor,
    ctx: MicroBatchContext | None,
    policy: str,
    backend: Backend,
    weights: list[torch.Tensor],
    space: ActivationSpace,
    k: int,
    balance: StepBalance | None,
) -> tuple[torch.Tensor, MicroBatchContext | None, Saved]:
    if policy in RECOMPUTES:
        rng = backend.rng_state()
        with torch.no_grad():
            y, ctx2, _ = _run(adapter, b, x, ctx, balance, k)
        if policy == "recompute_cpu":
            offloaded = _Offloaded(x.detach(), space, f"input of block {b}")
            return y, ctx2, Saved(policy, None, None, ctx, rng, offloaded=offloaded)
        return y, ctx2, Saved(policy, x.detach(), None, ctx, rng)
    x_in = _input(x)
    (y, ctx2, router), hooks = _graph(policy, b, k, weights, space, lambda: _run(adapter, b, x_in, ctx, balance, k))
    return y.detach(), ctx2, Saved(policy, x_in, y, ctx, swap=hooks, router=router)


def backward(
    adapter: Adapter,
    b: int,
    saved: Saved,
    dy: torch.Tensor,
    backend: Backend,
    k: int = 0,
    balance: StepBalance | None = None,
) -> torch.Tensor | None:
    """Backward of block ``b`` for micro-batch ``k``; gradients accumulate into the bound params' ``.grad``.

    With ``balance``, the block's routers also get the balance loss's gradient (``StepBalance.seed``).
    Returns the gradient of the block input (None for token ids).
    """
    if adapter.additive(b):
        return _backward_additive(adapter, b, saved, dy, backend)
    layer = adapter.route_of(b)
    leaves = saved.ctx.routes.pop(layer) if layer is not None and saved.ctx is not None else None
    x_in, y, router, route = saved.x, saved.y, saved.router, saved.route
    if saved.policy in RECOMPUTES:
        x_in = _input(saved.input())
        state = backend.rng_state()
        backend.set_rng_state(saved.rng)
        with torch.enable_grad():
            if balance is None:
                y, _ = adapter.forward(b, x_in, saved.ctx)
            else:
                with adapter.routes() as routed:
                    y, _ = adapter.forward(b, x_in, saved.ctx)
                router = prob_sums(routed) if routed else None
        backend.set_rng_state(state)
        if layer is not None and saved.ctx is not None:
            route = saved.ctx.routes.pop(layer)  # the recomputation's: in the graph
    assert y is not None and x_in is not None  # kept by forward, or recomputed just now
    if not y.requires_grad:  # a frozen block nothing trainable feeds (LoRA: the embedding)
        saved.release()
        return None
    outs, grads = [y], [dy]
    if router is not None and balance is not None:
        outs.append(router)
        grads.append(balance.seed(k))
    if route is not None and leaves is not None:  # what the expert groups sent back
        for out, leaf in ((route.hn, leaves.hn), (route.w, leaves.w)):
            if leaf.grad is not None:
                outs.append(out)
                grads.append(leaf.grad)
    torch.autograd.backward(outs, grads)
    saved.router = saved.route = None
    saved.release()
    return x_in.grad if x_in.requires_grad else None


def _backward_additive(adapter: Adapter, b: int, saved: Saved, dy: torch.Tensor, backend: Backend) -> torch.Tensor:
    """Backward of an ``additive`` block: the delta's graph (kept, or recomputed now) gets ``dy``; its
    weights' and its route leaves' gradients accumulate; ``dy`` passes on as the input's gradient."""
    delta = saved.y
    if saved.policy in RECOMPUTES:
        assert saved.ctx is not None  # made by the embedding block
        if saved.parked_route is not None:  # the route back from host memory, a leaf for the groups
            layer, idx, w = saved.parked_route
            saved.ctx.routes[layer] = Route(_input(saved.input()), idx, w)
            saved.parked_route = None
        state = backend.rng_state()
        backend.set_rng_state(saved.rng)
        with torch.enable_grad():
            delta = adapter.delta(b, saved.ctx)
        backend.set_rng_state(state)
    assert delta is not None  # kept by forward, or recomputed just now
    if delta.requires_grad:  # no token routed to the group: nothing to send back
        torch.autograd.backward(delta, dy.reshape(delta.shape).to(delta.dtype))
    saved.release()
    return dy


def prefetch(saved: list[Saved]) -> None:
    """Start reading a block's SSD-swapped activations back (before its backward)."""
    for s in saved:
        if s.swap is not None and s.swap.record is not None:
            s.swap.record.prefetch()


def upload(saved: Saved | None) -> None:
    """Start copying one (block, micro-batch)'s swapped activations or offloaded input back onto the
    device, so the copy overlaps the compute queued before its backward (swap_cpu, swap_ssd once read
    back, recompute_cpu; None or other policies: nothing)."""
    if saved is None:
        return
    if saved.swap is not None:
        saved.swap.upload()
    if saved.offloaded is not None:
        saved.offloaded.upload()
