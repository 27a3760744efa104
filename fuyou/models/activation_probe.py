"""What a block holds on the device while it computes, measured on the model's own modules at no
memory: each block's forward and backward run on fake tensors (``torch``'s ``FakeTensorMode``: shapes,
dtypes and every allocation as the real kernels make them, no storage behind them) under the CPU
backend's allocation meter (``fuyou.device.cpu_allocations.Allocations``), which sees each storage an
op makes and, through a weak reference, when it is freed.

Measured per block, at the run's sequence length and compute dtype (``BlockMemory``): what its forward
leaves for backward (autograd's saved tensors), the transient peak of a forward without autograd (the
``recompute`` and swap policies' first pass), the transient peak of a forward with autograd above what
it leaves, and the transient peak of its backward above what it started from (the input's gradient
excluded: ``fuyou.schedule.device_memory`` counts that, and the fresh weight gradient it adds into the
block's preset buffer included), and that backward's peak again when the saved tensors come back one
by one (a swapped block nothing uploaded ahead). Each is measured at the micro-batch's own shape: a
peak is the largest of several moments, some growing with the tokens and some not (a weight's fresh
gradient), so no per-token slope taken at one shape holds at another.

The device-memory model (``fuyou.schedule.device_memory``) holds these figures; the description
(``fuyou.models.description``) hands the planner and the engine's admission a probe per model. Blocks
that cannot run on fake tensors — shapes that depend on values, or a kernel whose fake rule refuses what
the real one runs — get None from ``probe_block``, and the family's rule
(``fuyou.models.activation_rules``) stands in. (The grouped matmul of this year's mixtures of experts
has a fake rule for bf16 only; the probe gives it one for fp32: ``_Counting``.) Fake tensors run the CPU's kernels: on CUDA,
attention's kernels (flash, memory-efficient) save about the same (the output and a log-sum-exp per
query), other ops alike.

Cost: one fake forward and backward per block kind, micro-batch shape and dtype (0.05–0.3 s on a
2-core CPU), cached per (model, block kind, compute dtype, micro-batch shape).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fuyou.device.cpu_allocations import Allocations
from fuyou.models.adapters import Adapter, Route
from fuyou.schedule.device_memory import BlockMemory

DTYPES = {2: torch.bfloat16, 4: torch.float32}
"""Compute dtype by element size (bytes)."""


class _Meter:
    """Bytes of the storages charged and not yet freed, and their peak since ``mark``."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def charge(self, storage: torch.UntypedStorage, _what: object) -> None:
        n = int(storage.nbytes())
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, n)

    def _free(self, n: int) -> None:
        self.now -= n

    def mark(self) -> int:
        """Start a new peak from now; returns the bytes held now."""
        self.peak = self.now
        return self.now


_FAKE_REFUSALS = (RuntimeError, NotImplementedError)
"""What fake tensors raise where a block cannot run on them: shapes that depend on values
(``DataDependentOutputException``, ``DynamicOutputShapeException``), or a kernel without a fake rule."""


class _Counting(Allocations):
    """The allocation meter, and a fake rule for the grouped matmul in fp32: torch's accepts bf16
    only, its CPU kernel (and the engine's fp32 runs of this year's mixtures of experts) fp32 too.
    The product's shape comes from the bf16 rule; the fp32 output is charged as the real kernel's."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is not _GROUPED_MM or args[0].dtype != torch.float32:
            return super().__torch_dispatch__(func, types, args, kwargs)
        half = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        shaped = func(*half, **(kwargs or {}))
        out = torch.empty_strided(shaped.shape, shaped.stride(), dtype=torch.float32)
        self.charge(out.untyped_storage(), "grouped matmul")
        return out


_GROUPED_MM = torch.ops.aten._grouped_mm.default


def probe_block(adapter: Adapter, b: int, compute_bytes: int, seq_len: int, micro_batch: int = 1) -> BlockMemory | None:
    """Measure block ``b`` of ``adapter`` (a meta skeleton, ``fuyou.models.adapters``) at
    ``compute_bytes`` per element on a micro-batch of ``micro_batch × seq_len`` tokens. None for the embedding, the head
    (both modelled apart), a later vocabulary group of the embedding, and a block
    whose forward depends on values (a family whose experts dispatch tokens by data-dependent shapes). Raises KeyError for a compute size other than 2
    or 4 bytes."""
    H = len(adapter.blocks) - 1
    if b == H and not adapter.head_rows:
        got = _try(_measure_head, adapter, b, DTYPES[compute_bytes], micro_batch, seq_len)
    elif b == 0:
        got = _try(_measure_embed, adapter, b, DTYPES[compute_bytes], micro_batch, seq_len)
    elif b >= adapter.first_head or (adapter.additive(b) and b not in adapter.slices):
        return None
    else:
        got = _try(_measure, adapter, b, DTYPES[compute_bytes], micro_batch, seq_len)
    if got is None:
        return None
    T = micro_batch * seq_len
    per = {k: max(0.0, v / T) for k, v in got.items()}
    return BlockMemory(
        per["saved"], per["fwd"], 0.0, per["keep_fwd"], per["bwd"], 0.0, per["lazy"], 0.0, per.get("handed", 0.0)
    )


def _try(
    measure: Callable[[Adapter, int, torch.dtype, int, int], dict[str, float]],
    adapter: Adapter,
    b: int,
    dtype: torch.dtype,
    batch: int,
    seq_len: int,
) -> dict[str, float] | None:
    """``measure(adapter, b, dtype, batch, seq_len)``, or None where the block cannot run on fake
    tensors (torch's own log of the refusal silenced: it is expected, and the caller falls back)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        return measure(adapter, b, dtype, batch, seq_len)
    except _FAKE_REFUSALS:
        return None
    finally:
        log.setLevel(level)
        for o in {0, b, *_lenders(adapter, b)}:
            adapter.unbind(o)


def _measure_embed(adapter: Adapter, b: int, dtype: torch.dtype, batch: int, seq_len: int) -> dict[str, float]:
    """The embedding block's forward: the context it makes for the layers (positions, attention masks,
    rotary tables), which lives until the step's end, is ``saved``; the rest 0."""
    meter = _Meter()
    with FakeTensorMode():
        adapter.prepare(torch.device("cpu"))
        _bind(adapter, b, dtype, grads=False)
        ids = torch.zeros(batch, seq_len, dtype=torch.long)
        with _Counting(meter.charge, "probe of the embedding"):
            base = meter.mark()
            with torch.no_grad():
                y, ctx = adapter.forward(b, ids, None)
            held = meter.now - base - y.nbytes
        del y, ctx
    return {"saved": held, "fwd": 0.0, "keep_fwd": 0.0, "bwd": 0.0, "lazy": 0.0}


def _measure_head(adapter: Adapter, b: int, dtype: torch.dtype, batch: int, seq_len: int) -> dict[str, float]:
    """The whole head's loss over ``batch × seq_len`` tokens as the engine runs one chunk of it
    (``fuyou.engine.turnaround.WholeHead``): the final norm, the logits, ``transformers``' causal-LM
    loss and its backward at once, the head's gradient added into its preset buffer. Its peak above
    the start, the input's gradient excluded, is ``bwd``; the rest 0."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    meter, vocab = _Meter(), adapter.config.vocab_size
    with FakeTensorMode():
        adapter.prepare(torch.device("cpu"))
        _bind(adapter, b, dtype, grads=True)
        x = torch.zeros(batch, seq_len, adapter.hidden, dtype=dtype)
        labels = torch.zeros(batch, seq_len, dtype=torch.long)
        with _Counting(meter.charge, "probe of the head"):
            base = meter.mark()
            piece = x.detach().requires_grad_()
            logits, _ = adapter.forward(b, piece, None)
            one: Any = 1  # transformers annotates it as a Tensor; it divides by it, an int works
            loss = ForCausalLMLoss(logits, None, vocab, num_items_in_batch=one, shift_labels=labels)
            del logits
            loss.backward()
            bwd = meter.peak - base - x.nbytes
    return {"saved": 0.0, "fwd": 0.0, "keep_fwd": 0.0, "bwd": bwd, "lazy": 0.0}


def _lenders(adapter: Adapter, b: int) -> list[int]:
    """The blocks whose weights block ``b`` borrows (a tied head: the embedding)."""
    names = [s.name for s in adapter.blocks]
    return [names.index(o) for o in adapter.blocks[b].borrows]


def _measure(adapter: Adapter, b: int, dtype: torch.dtype, batch: int, seq_len: int) -> dict[str, float]:
    """Bytes (not per token) of one micro-batch of ``batch × seq_len`` tokens: see ``BlockMemory``."""
    meter = _Meter()
    with FakeTensorMode():
        adapter.prepare(torch.device("cpu"))
        _bind(adapter, 0, dtype, grads=False)
        with torch.no_grad():
            _, ctx = adapter.forward(0, torch.zeros(batch, seq_len, dtype=torch.long), None)
        x = torch.zeros(batch, seq_len, adapter.hidden, dtype=dtype)
        _hand_on(adapter, b, dtype, x, ctx)  # an earlier layer's value this one reads, first
        if b in adapter.slices:  # an expert group: its layer's core routes the tokens first
            _route(adapter, b, dtype, x, ctx)
        params = _bind(adapter, b, dtype, grads=True)
        out_bytes = x.nbytes
        with _Counting(meter.charge, f"probe of block {b}"):
            base = meter.mark()
            before = set(ctx.handed)
            with torch.no_grad():
                y, _ = adapter.forward(b, x, ctx)
            fwd = meter.peak - base - out_bytes
            handed = sum(t.nbytes for i, t in ctx.handed.items() if i not in before)
            del y
            base = meter.mark()
            x_in = x.detach().requires_grad_()
            y, _ = adapter.forward(b, x_in, ctx)
            held = meter.now - base
            keep_fwd = meter.peak - base - held
            dy = torch.zeros_like(y)
            base = meter.mark()
            torch.autograd.backward(y, dy)
            bwd = meter.peak - base - out_bytes
            del y, dy, x_in
            weights = {id(p.untyped_storage()) for p in params}
            lazy = _lazy_backward(adapter, b, x, ctx, meter, weights) - out_bytes
    return {"saved": held - out_bytes, "fwd": fwd, "keep_fwd": keep_fwd, "bwd": bwd, "lazy": lazy, "handed": handed}


def _lazy_backward(adapter: Adapter, b: int, x: torch.Tensor, ctx: Any, meter: _Meter, weights: set[int]) -> int:
    """The backward peak (above its start) of block ``b`` whose saved tensors were moved off the
    device in forward and come back one by one as autograd asks for them (a swapped block nothing
    uploaded ahead: ``fuyou.engine.activations._Swap``): each non-weight tensor dropped when saved
    (once, however often autograd saves it), a fresh one of its shape made when unpacked, kept while
    autograd holds it."""
    back: dict[int, weakref.ref] = {}
    seen: dict[tuple, tuple[weakref.ref, Any]] = {}

    def pack(t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        if id(storage) in weights or t.numel() == 0:
            return t
        key = (id(storage), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        hit = seen.get(key)
        if hit is not None and hit[0]() is storage:
            return hit[1]
        packed = (tuple(t.shape), t.dtype)
        seen[key] = (weakref.ref(storage), packed)
        return packed

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        ref = back.get(id(packed))
        t = ref() if ref is not None else None
        if t is None:
            t = torch.zeros(packed[0], dtype=packed[1])
            back[id(packed)] = weakref.ref(t)
        return t

    x_in = x.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y, _ = adapter.forward(b, x_in, ctx)
    dy = torch.zeros_like(y)
    base = meter.mark()
    torch.autograd.backward(y, dy)
    return meter.peak - base


def _route(adapter: Adapter, b: int, dtype: torch.dtype, x: torch.Tensor, ctx: Any) -> None:
    """Run the core of expert group ``b``'s layer on ``x`` (no autograd) and leave its ``Route`` in
    ``ctx`` as the engine hands it to the groups: its hidden states and weights leaves that take gradients."""
    layer = adapter.layer_of[b]  # type: ignore[attr-defined]  # set by every adapter that splits experts
    core = next(c for c in range(1, b) if adapter.route_of(c) == layer)
    _bind(adapter, core, dtype, grads=False)
    with torch.no_grad():
        adapter.forward(core, x, ctx)
    adapter.unbind(core)
    r = ctx.routes[layer]
    ctx.routes[layer] = Route(r.hn.detach().requires_grad_(), r.idx, r.w.detach().requires_grad_())


def _hand_on(adapter: Adapter, b: int, dtype: torch.dtype, x: torch.Tensor, ctx: Any) -> None:
    """Run (no autograd) the earlier layer whose handed-on value block ``b``'s layer reads
    (``families.HANDED_ON``: GLM-5's top-k indices), leaving that value in ``ctx`` as the engine's
    forward does; nothing for a layer that reads none."""
    layer = adapter.layer_of[b] if adapter.reads is not None else -1  # type: ignore[attr-defined]
    src = adapter.reads[layer] if adapter.reads is not None and layer >= 0 else None
    if src is None:
        return
    source = adapter.layer_of.index(src)  # type: ignore[attr-defined]  # its core block, before any expert group
    _bind(adapter, source, dtype, grads=False)
    with torch.no_grad():
        adapter.forward(source, x, ctx)
    adapter.unbind(source)


def _bind(adapter: Adapter, b: int, dtype: torch.dtype, grads: bool) -> list[torch.nn.Parameter]:
    """Bind fake weights of ``dtype`` to block ``b``; with ``grads``, a preset gradient for each that
    trains (the engine points every ``.grad`` at its block's flat buffer: backward adds into it)."""
    tensors: dict[str, Any] = {}
    for key, shape in _keys(adapter, b):
        tensors[key] = torch.zeros(shape, dtype=dtype)
    for buf in adapter.blocks[b].buffers:  # the family's (router biases): held through the run, not the block's
        tensors[buf.key] = torch.zeros(buf.shape, dtype=buf.dtype(dtype))
    params = list(adapter.bind(b, tensors).values())
    for p in params:
        if grads and p.requires_grad:
            p.grad = torch.zeros_like(p)
    return params


def _keys(adapter: Adapter, b: int) -> list[tuple[str, tuple[int, ...]]]:
    """(key ``bind`` looks up, shape) of each of block ``b``'s parameters, a tied head's borrowed one included."""
    own = [b, *_lenders(adapter, b)]
    return [(p.key, p.shape) for o in own for p in adapter.blocks[o].params]
