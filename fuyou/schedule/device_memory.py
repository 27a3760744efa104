"""Device memory, written once: what a step holds on the device at its peak, phase by phase, as the
engine runs it (``fuyou/engine/step.py``). The planner predicts with it (``fuyou.planner.cost``) and the
engine admits a batch shape with it before the step allocates anything (``Engine._admit_shape``).
Plain Python, no torch.

The engine computes one block at a time over ``K`` micro-batches of ``t`` tokens; ``x = t × hidden ×
compute_bytes`` is one micro-batch's hidden state. Each block's own figures (``BlockMemory``: what it
saves for backward, its forward and backward transients) are measured on the model's own modules at
the micro-batch's shape (``fuyou.models.activation_probe``, through the model's description), or come
from the family's rule where those cannot run on fake tensors (``FWD_WORK``, ``BWD_WORK``,
``LAZY_SHARE``). What a block ``a`` leaves on the device from its forward to its backward, per
micro-batch (``resident``): ``keep`` its saved tensors and one hidden state, ``recompute`` its input
(an expert group none, the layer's last group its route), ``swap_*`` its output (the graph's root: the
saved tensors move off), ``recompute_cpu`` nothing; and under every policy what it hands on to later
layers (``BlockMemory.handed_per_token``: GLM-5's top-k indices). The phases:

* forward of ``b``: Σ_{a≤b} K·resident(a) + b's weights + inputs and outputs (2·K·x) + the transient
  of one micro-batch's forward (with autograd, ``keep``, or without it, the other policies);
* the turnaround (head): Σ_{a<H} K·resident(a) + the head's weights and gradients (and a tied
  embedding's) + its inputs and their gradients (2·K·x) + one chunk's loss, forward and backward
  (``sizing.loss_chunk_tokens`` tokens; the head's ``BlockMemory.bwd_per_token``: its final norm,
  logits, their fp32 upcast and gradients, measured, or by rule 8 + 2 × compute_bytes per token and
  vocabulary entry); a head split
  by vocabulary rows (``fuyou.schedule.vocab``) holds one group's weights and gradients at a time and,
  besides, the normed hidden states (K·x) and their fp32 gradient, its backward pass the larger;
* backward of ``b``: Σ_{a≤b} K·resident(a) + b's weights (none for an embedding whose graph was kept:
  ``rules.reads_weights_in_backward``) and gradients + output gradients in and
  input gradients out (2·K·x) + one micro-batch's backward transient (a weight's fresh gradient,
  added into the block's buffer, included) + what comes back for it (``recompute``: its saved tensors
  again; ``swap_*``: those of this micro-batch and its input — for the first block backward reaches,
  which nothing uploaded ahead, from host memory one by one as autograd asks, measured so;
  ``recompute_cpu``: its input and its saved tensors) + what is uploaded one ahead (the next
  micro-batch's, or the block below's first) + from the head's backward on, the gradient buffers of
  blocks the head borrows (a tied embedding: ``DeviceBlock.lends``).

The peak is the largest phase, ``ALLOWANCE`` more, plus what lives through the step: LoRA adapters
with their moments, a reduce-scattered gradient shard, the backend's libraries
(``sizing.library_bytes``). Predicted ÷ measured (the CPU backend's allocation meter,
``fuyou.device.cpu_allocations``, on every tensor compute allocates): ``bench/bench_device_peak.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fuyou.schedule import rules, sizing
from fuyou.schedule.plan import Plan

FWD_WORK = 3.5
"""The rule where a block cannot be measured: a no-grad forward's transient peak, in ``work`` elements per token (gate, up, the activation and
their product of a gated MLP, less what is freed on the way): 3.4 measured on SmolLM2, bf16 and fp32."""
ALLOWANCE = 0.05
"""Share added to each phase for what the model does not itemise (small tensors, rounding, the
allocator's slack)."""
ADAPTER_BYTES_PER_PARAM = 16
"""A LoRA adapter parameter on the device: fp32 weight, gradient, and AdamW's m and v."""
BWD_WORK = {2: 2.5, 4: 2.0}
"""The rule where a block cannot be measured: backward's transient peak in ``work`` elements per token, by compute element size: 2.1–2.5 in bf16,
1.4–2.0 in fp32 measured on SmolLM2 and tiny Llamas (``keep`` and ``recompute``)."""


@dataclass(frozen=True)
class BlockMemory:
    """What one block holds on the device while it computes, per micro-batch of ``t`` tokens:
    ``per_token × t + fixed`` (bytes), at one micro-batch shape. Measured on the model's own modules
    at that shape (``fuyou.models.activation_probe``: fixed parts 0), or the family's rule where they
    cannot run on fake tensors."""

    saved_per_token: float
    """What its forward leaves for backward (autograd's saved tensors, its input and output excluded)."""
    fwd_per_token: float
    """A forward without autograd: its transient peak, its output excluded."""
    fwd_fixed: float
    keep_fwd_per_token: float
    """A forward with autograd: its transient peak above what it leaves (saved tensors and output)."""
    bwd_per_token: float
    """Its backward: the transient peak above what it started from, the input's gradient excluded."""
    bwd_fixed: float
    lazy_bwd_per_token: float
    """Its backward when its saved tensors come back one by one as autograd asks for them (swapped,
    nothing uploaded ahead): the peak above what it started from, what came back included."""
    lazy_bwd_fixed: float
    handed_per_token: float = 0.0
    """What its forward hands on to later layers (``fuyou.models.families.HANDED_ON``: GLM-5's top-k
    indices), kept on the device with the micro-batch's context until the step's end, whatever its policy."""


@dataclass(frozen=True)
class DeviceBlock:
    """One block as device memory sees it (bytes)."""

    name: str
    kind: str
    """``embed`` | ``layer`` | ``experts`` | ``head`` (``fuyou.schedule.shapes.BlockShape.kind``)."""
    weights: int
    """Its weights on the device while it computes (read-only part and, for the head, a tied
    embedding's included; gathered when sharded)."""
    grads: int
    """Its gradient buffers during backward (a tied embedding's too, for the head; 0 if frozen)."""
    mem: BlockMemory
    """What it holds while it computes (saved tensors, transients) at the run's sequence length."""
    keeps_input: bool = True
    """Whether ``recompute`` keeps its input (or route) on the device: not an expert group's."""
    lends: bool = False
    """The head borrows this block's weights (a tied embedding): its gradient buffer, filled first by
    the head's backward, stays on the device until its own backward."""
    rows: int = 0
    """The head's vocabulary rows (a head group's share, ``fuyou.schedule.vocab``); 0 for other blocks."""


@dataclass(frozen=True)
class DeviceRun:
    """What a step computes on: micro-batch shape, accumulation, sizes (bytes per element)."""

    micro_batch: int
    seq_len: int
    accum: int
    hidden: int
    compute_bytes: int
    vocab: int
    logit_chunk_tokens: int
    """Tokens whose logits the loss holds at once (``sizing.loss_chunk_tokens``)."""
    resident: int = 0
    """Bytes living through the step besides the blocks: adapters, a gradient shard, libraries."""

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.micro_batch * self.seq_len


@dataclass(frozen=True)
class DevicePeak:
    """The predicted device peak (bytes), the phase it falls in, and each block kind's largest phase."""

    nbytes: int
    phase: str
    by_kind: dict[str, int] = field(default_factory=dict)


def step_run(
    micro_batch: int,
    seq_len: int,
    accum: int,
    hidden: int,
    compute_bytes: int,
    vocab: int,
    *,
    adapter_params: int = 0,
    shard_grad_bytes: int = 0,
    device: str = "cpu",
    device_bytes: int = 0,
    held_bytes: int = 0,
) -> DeviceRun:
    """A step's ``DeviceRun``: its loss chunk under a ``device_bytes`` budget (0: none;
    ``sizing.loss_chunk_tokens``), and what lives through it — LoRA adapters
    (``ADAPTER_BYTES_PER_PARAM`` each), a reduce-scattered gradient shard, the family's persistent
    buffers (``held_bytes``: ``ModelShape.held_bytes``), the ``device`` backend's libraries
    (``sizing.library_bytes``)."""
    return DeviceRun(
        micro_batch, seq_len, accum, hidden, compute_bytes, vocab,
        sizing.loss_chunk_tokens(vocab, compute_bytes, device_bytes),
        ADAPTER_BYTES_PER_PARAM * adapter_params + shard_grad_bytes + held_bytes + sizing.library_bytes(device),
    )  # fmt: skip


def block_policies(plan: Plan, nblocks: int) -> list[str]:
    """Each block's activation policy under ``plan`` (the head's, which the model ignores, ``keep``)."""
    return ["keep" if b == nblocks - 1 else plan.policy(b, nblocks) for b in range(nblocks)]


def logit_tokens(run: DeviceRun, rows: int = 0) -> int:
    """Tokens of one loss chunk as the engine splits it: whole sequence positions of the micro-batch;
    for a head group of ``rows`` vocabulary rows (0: the whole head), a chunk of the same bytes."""
    chunk = run.logit_chunk_tokens if not rows else max(1, run.logit_chunk_tokens * run.vocab // rows)
    per_seq = max(1, chunk // run.micro_batch)
    return min(run.seq_len, per_seq) * run.micro_batch


def resident(blk: DeviceBlock, policy: str, run: DeviceRun) -> float:
    """Bytes block ``blk`` leaves on the device for its backward, per micro-batch, under ``policy``."""
    x = run.tokens * run.hidden * run.compute_bytes
    handed = blk.mem.handed_per_token * run.tokens  # in the micro-batch's context, as the embedding's masks
    if blk.kind == "embed":  # its output and the context it makes (masks, rotary tables): until the step's end
        return blk.mem.saved_per_token * run.tokens + x
    if policy == "keep":
        return blk.mem.saved_per_token * run.tokens + x + handed
    if policy == "recompute":
        return x * blk.keeps_input + handed  # its input (an expert group none; the last its route)
    return handed + (0.0 if policy == "recompute_cpu" else x)  # swap_*: its output, the graph's root


LAZY_SHARE = 0.25
"""Share of a swapped block's saved tensors on the device at its backward's peak when nothing uploaded
them ahead (the first block backward reaches): autograd copies each back as it needs it and frees it
after (measured 0.18 on a Llama layer)."""


def _brought_back(
    blk: DeviceBlock, policy: str, run: DeviceRun, below: tuple[DeviceBlock, str] | None, first: bool
) -> float:
    """What a micro-batch's backward of ``blk`` holds above what it started from, the largest over its
    micro-batches: its transient (``BlockMemory.bwd_*``) and what comes back for it — its own saved
    tensors — and what is uploaded one ahead while it computes: its next micro-batch's, or after its
    last the first of the block ``below`` (block, policy) if that one is offloaded too. The first
    micro-batch of the first block backward reaches (``first``) had nothing uploaded ahead: from host
    memory (``swap_cpu``) its tensors come back one by one, as autograd asks
    (``BlockMemory.lazy_bwd_*`` in place of them and the transient); from SSD all at once."""
    x = run.tokens * run.hidden * run.compute_bytes
    m, T = blk.mem, run.tokens

    def off(b: DeviceBlock, pol: str) -> float:
        if pol in ("swap_cpu", "swap_ssd"):
            return b.mem.saved_per_token * run.tokens + x
        return x * b.keeps_input if pol == "recompute_cpu" else 0.0

    own = off(blk, policy)
    below_first = off(*below) if below is not None else 0.0
    ahead = max(own if run.accum > 1 else 0.0, below_first)
    recomputed = m.saved_per_token * T if policy in ("recompute", "recompute_cpu") else 0.0
    if not (first and policy == "swap_cpu"):
        return own + ahead + recomputed + m.bwd_per_token * T + m.bwd_fixed
    lazy = m.lazy_bwd_per_token * T + m.lazy_bwd_fixed + (own if run.accum > 1 else below_first)
    if run.accum == 1:
        return lazy
    later = own + max(own if run.accum > 2 else 0.0, below_first) + m.bwd_per_token * T + m.bwd_fixed
    return max(lazy, later)  # the micro-batches after the first were uploaded ahead


def device_peak(blocks: Sequence[DeviceBlock], policies: Sequence[str], run: DeviceRun) -> DevicePeak:
    """The device peak of one step (see the module docstring). ``policies``: one per block, the
    head's ignored. Raises ValueError if the lengths differ."""
    ph = phases(blocks, policies, run)
    by_kind: dict[str, int] = {}
    for _, kind, n in ph:
        by_kind[kind] = max(by_kind.get(kind, 0), n)
    name, _, top = max(ph, key=lambda p: p[2])
    return DevicePeak(top, name, by_kind)


def phases(blocks: Sequence[DeviceBlock], policies: Sequence[str], run: DeviceRun) -> list[tuple[str, str, int]]:
    """(phase, block kind, peak bytes) of each phase of one step, in the engine's order (module
    docstring), what lives through the step included. Raises ValueError if the lengths differ."""
    if len(policies) != len(blocks):
        raise ValueError(f"{len(policies)} activation policies for {len(blocks)} blocks")
    H, K, cb = len(blocks) - 1, run.accum, run.compute_bytes
    F = first_head(blocks)
    x = run.tokens * run.hidden * cb
    out: list[tuple[str, str, float]] = []
    kept = 0.0
    for b, blk in enumerate(blocks[:F]):
        kept += K * resident(blk, policies[b], run)
        T = run.tokens
        m = blk.mem
        work = m.fwd_per_token * T + m.fwd_fixed if policies[b] != "keep" else m.keep_fwd_per_token * T
        out.append((f"forward of {blk.name}", blk.kind, kept + blk.weights + 2 * K * x + work))
    if F == H:
        head = blocks[H]
        logits = head.mem.bwd_per_token * logit_tokens(run)
        out.append(("the head's loss", "head", kept + head.weights + head.grads + 2 * K * x + logits))
    else:  # split by vocabulary rows: the backward pass, per group, holds the normed states and their fp32 gradient
        split = K * x + K * run.tokens * run.hidden * 4
        per = cb + 4 + (4 if cb != 4 else 0)  # the logits, their fp32 copy (none in fp32), its softmax
        for blk in reversed(blocks[F:]):
            logits = per * logit_tokens(run, blk.rows) * blk.rows
            peak = kept + blk.weights + blk.grads + 2 * K * x + split + logits
            out.append((f"the loss's backward by {blk.name}", "head", peak))
    lent = [blk for blk in blocks[:F] if blk.lends]
    kept += sum(blk.grads for blk in lent)  # filled by the head, kept until the lender's own backward
    for b in range(F - 1, -1, -1):
        blk = blocks[b]
        if blk.lends:
            kept -= blk.grads  # counted with the block below
        below = (blocks[b - 1], policies[b - 1]) if b else None
        back = _brought_back(blk, policies[b], run, below, first=b == F - 1)
        weights = blk.weights if rules.reads_weights_in_backward(blk.kind, policies[b]) else 0
        out.append((f"backward of {blk.name}", blk.kind, kept + weights + blk.grads + 2 * K * x + back))
        kept -= K * resident(blk, policies[b], run)
    return [(name, kind, int(n * (1 + ALLOWANCE) + run.resident)) for name, kind, n in out]


def first_head(blocks: Sequence[DeviceBlock]) -> int:
    """The head's first block: the last block, or the first of its vocabulary groups."""
    F = len(blocks) - 1
    while F > 0 and blocks[F - 1].kind == "head":
        F -= 1
    return F
