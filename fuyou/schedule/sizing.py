"""Host-memory sizing, written once: the buffer classes a plan reserves, the RAM tier's bytes, the
budget rules that fit a plan into ``--cpu-memory``, and the device floor. The engine reserves exactly
``buffer_classes`` (``fuyou/engine/engine.py``); the planner's cost model counts the same bytes
(``fuyou/planner/cost.py``). Plain Python, no torch.

Host memory a plan reserves (every buffer rounded up to ``HOST_ALIGN``, as the pool counts):
``prefetch_depth + 1`` weight buffers (largest block), 2 gradient and 2 new-weight buffers (largest
block), ``state_buffers`` optimizer-state chunks, one parked gradient per block that parks in RAM
(``rules.parked_in_ram``), and the RAM tier: the compute weights of the first ``ram_weight_blocks``
blocks, the master + m + v of the first ``ram_state_blocks`` (12 B/param, 8 with bf16 m/v). Only
the classes that cross PCIe are pinned on CUDA (``crosses_pcie``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fuyou.schedule.plan import MIN_CHUNK, Plan
from fuyou.schedule.rules import parked_in_ram
from fuyou.schedule.state_format import FORMATS, StateFormat
from fuyou.units import HOST_ALIGN, align_up

WEIGHTS, GRADS, STATE, NEW_WEIGHTS = "weights", "grads", "state", "new-weights"
ADAPTERS = "lora adapters"
"""The one buffer LoRA adapters and their moments go through to and from the store (checkpoints,
resume), 12 B per adapter parameter (fp32 weight, m and v)."""
"""Host buffer classes of the streaming path (names as the pool reports them)."""
RAM_WEIGHTS, RAM_STATE = "ram-tier weights", "ram-tier optimizer state"
HOST_ONLY = frozenset({STATE, NEW_WEIGHTS, RAM_WEIGHTS, RAM_STATE})
"""Host buffer classes whose memory never takes part in a host ↔ device copy: optimizer state (SSD ↔
CPU Adam), new compute weights (CPU Adam → SSD or the RAM tier) and the RAM tier (memcpy'd into and
out of ``WEIGHTS``/``STATE`` buffers). Every other class — weights uploaded, gradients downloaded
(``GRADS``, ``park/<b>``), any class not named here — crosses PCIe (``crosses_pcie``)."""


def park_class(b: int) -> str:
    """Host buffer class for block ``b``'s gradient parked in RAM."""
    return f"park/{b}"


def crosses_pcie(name: str) -> bool:
    """Whether buffers of class ``name`` are copied to or from the device, so must be page-locked
    (pinned) on CUDA for asynchronous copies at full PCIe bandwidth; False for ``HOST_ONLY`` classes,
    which stay pageable (pinned memory is scarce: ``ulimit -l``, and the kernel cannot swap or
    compact it)."""
    return name not in HOST_ONLY


def staged_offset(weight_bytes: int) -> int:
    """Where a block's read-only part (``--freeze``) starts in the host buffer its weights are read
    into: after its ``weight_bytes`` of compute weights, at the next page boundary."""
    return align_up(weight_bytes, HOST_ALIGN)


@dataclass(frozen=True)
class Footprint:
    """What sizing needs to know of a model: per block (layout order) the bytes of its compute-weight
    extent and its flat element count, the element sizes, and the blocks the head borrows."""

    weight_bytes: tuple[int, ...]
    """Bytes of each block's compute-weight extent (its tensors at 64-byte alignment)."""
    numels: tuple[int, ...]
    """Elements of each block's flat gradient and optimizer-state vectors."""
    compute_bytes: int
    """Bytes per weight/gradient element: 2 (bf16) or 4 (fp32)."""
    state_format: StateFormat = FORMATS["fp32"]
    """How the optimizer state is stored (``fuyou.schedule.state_format``): its chunks' bytes."""
    borrowed: tuple[int, ...] = ()
    """Blocks whose weights the head also uses (a tied embedding)."""
    world: int = 1
    """Data-parallel ranks: the host holds one rank's shard (``weight_bytes``, ``numels``), the
    device the gathered block (``device_bytes``)."""
    adapter_bytes: int = 0
    """Bytes of the LoRA adapters' store extent (0: none), staged through one host buffer."""
    frozen: tuple[int, ...] = ()
    """Blocks that never train (``--freeze``): no gradient leaves the device, no state, no update."""
    frozen_numels: tuple[int, ...] = ()
    """Elements of each block's read-only part (parameters ``--freeze`` freezes in a block that trains;
    one rank's shard), stored apart from ``weight_bytes``; empty: none anywhere."""

    def frozen_bytes(self, b: int) -> int:
        """Bytes of block ``b``'s read-only part (0 without one)."""
        return self.frozen_numels[b] * self.compute_bytes if self.frozen_numels else 0

    def staged_bytes(self, b: int) -> int:
        """Host bytes of block ``b``'s weights as read: the compute-weight extent, then its read-only
        part from the next page boundary."""
        f = self.frozen_bytes(b)
        return self.weight_bytes[b] if not f else staged_offset(self.weight_bytes[b]) + f

    @property
    def nblocks(self) -> int:
        """Number of blocks."""
        return len(self.numels)

    def grad_bytes(self, b: int) -> int:
        """Bytes of block ``b``'s flat gradient."""
        return self.numels[b] * self.compute_bytes

    def device_bytes(self, b: int) -> int:
        """Device bytes of block ``b``'s weights and gradient while it computes: the whole block, and
        when sharded the gathered (padded) vectors plus the shard they come from and go to."""
        if self.world == 1:
            return self.weight_bytes[b] + self.frozen_bytes(b) + self.grad_bytes(b)
        return (self.world + 1) * (2 * self.grad_bytes(b) + self.frozen_bytes(b))

    def state_extent_bytes(self, n: int) -> int:
        """Bytes of one state extent of ``n`` elements as the store lays it out (``StateFormat.chunk_bytes``)."""
        return self.state_format.chunk_bytes(n, self.compute_bytes)


@dataclass(frozen=True)
class BufferClass:
    """``count`` host buffers of ``nbytes`` each, reserved under ``name``."""

    name: str
    nbytes: int
    count: int

    @property
    def reserved(self) -> int:
        """Bytes the pool counts for the class (each buffer page-rounded)."""
        return align_up(self.nbytes, HOST_ALIGN) * self.count


def state_chunks(numel: int, chunk: int) -> list[tuple[int, int]]:
    """Element ranges [lo, hi) of a block's optimizer-state chunks (one empty chunk for no elements)."""
    return [(lo, min(lo + chunk, numel)) for lo in range(0, numel, chunk)] or [(0, 0)]


def buffer_classes(fp: Footprint, plan: Plan) -> list[BufferClass]:
    """The host buffers ``plan`` streams through, in reservation order (the RAM tier apart). A frozen
    base (``Plan.lora_base``) streams weights only."""
    w = max(fp.staged_bytes(b) for b in range(fp.nblocks))
    adapters = [BufferClass(ADAPTERS, fp.adapter_bytes, 1)] if fp.adapter_bytes else []
    if plan.lora_base:
        return [BufferClass(WEIGHTS, w, plan.prefetch_depth + 1)] + adapters
    g = max(fp.grad_bytes(b) for b in range(fp.nblocks))
    state = fp.state_extent_bytes(min(plan.state_chunk, max(fp.numels)))
    out = [
        BufferClass(WEIGHTS, w, plan.prefetch_depth + 1),
        BufferClass(GRADS, g, 2),
        BufferClass(STATE, state, plan.state_buffers),
        BufferClass(NEW_WEIGHTS, max(fp.weight_bytes), 2),
    ]
    parked = [b for b in parked_in_ram(fp.nblocks, plan) if b not in fp.frozen]
    return out + adapters + [BufferClass(park_class(b), fp.grad_bytes(b), 1) for b in parked]


def ram_tier_extents(fp: Footprint, plan: Plan) -> tuple[list[int], list[int]]:
    """Bytes of each RAM-tier extent: (compute weights, and read-only parts, of blocks <
    ``ram_weight_blocks``, state chunks of blocks < ``ram_state_blocks``), in layout order."""
    ws = [n for b in range(plan.ram_weight_blocks) for n in (fp.weight_bytes[b], fp.frozen_bytes(b)) if n]
    ss = [
        fp.state_extent_bytes(hi - lo)
        for b in range(plan.ram_state_blocks)
        if b not in fp.frozen
        for lo, hi in state_chunks(fp.numels[b], plan.state_chunk)
    ]
    return ws, ss


def ram_tier_bytes(fp: Footprint, plan: Plan) -> int:
    """Host bytes of the RAM tier, each extent page-rounded (how it is carved from the pool)."""
    ws, ss = ram_tier_extents(fp, plan)
    return sum(align_up(n, HOST_ALIGN) for n in ws + ss)


def host_buffer_bytes(fp: Footprint, plan: Plan) -> int:
    """Bytes of the streaming buffers and RAM-parked gradients (``buffer_classes``)."""
    return sum(c.reserved for c in buffer_classes(fp, plan))


def host_need(fp: Footprint, plan: Plan) -> int:
    """Bytes of host memory ``plan`` reserves: its buffers and its RAM tier."""
    return host_buffer_bytes(fp, plan) + ram_tier_bytes(fp, plan)


CUDA_LIBRARY_BYTES = 64 << 20
"""Device bytes the CUDA backend's libraries take from the capped caching allocator besides the
tensors a plan counts: the compute stream's cuBLAS and cuBLASLt workspaces, 32 MiB each on Hopper
and later (allocated at the first matmul; about 8 MiB before Hopper). Measured on the first H100
(2026-11-26, torch 2.11): the allocated peak ran a constant ~28 MiB past a 32 MiB allowance for every
activation policy, and within 1.035–1.040 of the prediction with 64 MiB. The CUDA context (several
hundred MB) lies outside the allocator and outside ``--gpu-memory``."""

ALLOCATOR_ROUNDING_BYTES = 2 * (20 << 20) + 2 * (2 << 20)
"""Device bytes the caching allocator reserves beyond the live tensors, which the cap (torch's
per-process memory fraction) counts: each stream that allocates (compute, copy) keeps a partly used
20 MiB segment for blocks of 1–10 MiB and a 2 MiB segment for blocks under 1 MiB. Without it a cap
set to the predicted peak failed on the first H100 (2026-11-26); there the reserved peak ran 36–42 MiB
past the allocated one."""


def library_bytes(device: str) -> int:
    """Device bytes the ``device`` backend needs beyond a plan's tensors: on ``cuda``
    ``CUDA_LIBRARY_BYTES`` + ``ALLOCATOR_ROUNDING_BYTES``; 0 on ``cpu`` (its fake capacity counts
    tensors only)."""
    return CUDA_LIBRARY_BYTES + ALLOCATOR_ROUNDING_BYTES if device == "cuda" else 0


def device_floor(fp: Footprint, device: str = "cpu") -> int:
    """Device bytes no plan can go below on a ``device`` backend: the largest block's weights and
    gradients (the head's with the blocks it borrows), plus what its libraries need
    (``library_bytes``)."""
    per = [fp.device_bytes(b) for b in range(fp.nblocks)]
    return max(max(per), per[-1] + sum(per[o] for o in fp.borrowed)) + library_bytes(device)


LOSS_CHUNK_BYTES = 256 << 20
"""Device bytes of logits (and their gradients) the LM head's loss holds at once."""


LOSS_CHUNK_SHARE = 8
"""Under a device budget the logits take at most 1 / this of it (a 512 MiB budget: 64 MiB chunks)."""


def loss_chunk_tokens(vocab: int, compute_bytes: int, device_bytes: int = 0) -> int:
    """Tokens whose logits the head computes at once: the loss runs over a micro-batch in chunks of
    this many tokens, so its logits — per token and vocabulary entry the compute-dtype logit, its fp32
    upcast, their gradients: 8 + 2 × ``compute_bytes`` bytes — stay within ``LOSS_CHUNK_BYTES`` (a
    128 k vocabulary at 16 k tokens would otherwise hold ~24 GiB), and within ``device_bytes`` ÷
    ``LOSS_CHUNK_SHARE`` of a device budget (0: none given)."""
    cap = LOSS_CHUNK_BYTES if not device_bytes else min(LOSS_CHUNK_BYTES, device_bytes // LOSS_CHUNK_SHARE)
    return max(1, cap // ((8 + 2 * compute_bytes) * vocab))


def halve_chunk(chunk: int) -> int:
    """The next smaller state chunk the budget rules try: half, a multiple of 32, ≥ ``MIN_CHUNK``."""
    return max(MIN_CHUNK, chunk // 2 // 32 * 32)


def fit_host(fp: Footprint, plan: Plan, budget: int, fixed_chunk: bool = False, fixed_depth: bool = False) -> Plan:
    """``plan`` shrunk until ``host_need`` fits ``budget``: the state chunk first (halved down to
    ``MIN_CHUNK``; not with ``fixed_chunk``: a store's layout), then parked gradients move to SSD
    (fewer blocks' in RAM, from the last), then the prefetch depth (down to 1; not with
    ``fixed_depth``: a user's choice). The RAM tier is never shrunk.

    Returns the plan unchanged if it fits; if nothing fits, the smallest, which the pool's
    reservation then refuses naming every buffer class.
    """
    while not fixed_chunk and host_need(fp, plan) > budget and plan.state_chunk > MIN_CHUNK:
        plan = dataclasses.replace(plan, state_chunk=halve_chunk(plan.state_chunk))
    if host_need(fp, plan) > budget and parked_in_ram(fp.nblocks, plan):
        plan = dataclasses.replace(plan, park_ram_blocks=_ram_parks_that_fit(fp, plan, budget))
    while not fixed_depth and host_need(fp, plan) > budget and plan.prefetch_depth > 1:
        plan = dataclasses.replace(plan, prefetch_depth=plan.prefetch_depth - 1)
    return plan


def _ram_parks_that_fit(fp: Footprint, plan: Plan, budget: int) -> int:
    """The largest ``park_ram_blocks`` (≤ the plan's) whose host need fits ``budget``; 0 if none does."""
    n = fp.nblocks if plan.park_ram_blocks is None else plan.park_ram_blocks
    while n > 0 and host_need(fp, dataclasses.replace(plan, park_ram_blocks=n)) > budget:
        n -= 1
    return n
