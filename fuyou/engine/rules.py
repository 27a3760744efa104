"""Simple rules that fit a plan into the host budget (the cost-model planner will replace them).

Host memory Fuyou reserves: ``prefetch_depth + 1`` weight buffers (largest block), 2 gradient and
2 new-weight buffers (largest block), ``state_buffers`` optimizer-state chunks, with the clipping
schedule one parked gradient per block parked in RAM (with ``overlap_backward``, per RAM-tier block
1…R−1: ``ram_tier.rollback_blocks``; blocks from ``Plan.park_ram_blocks`` on park on SSD instead), and
the RAM tier itself (the compute weights of the first ``ram_weight_blocks`` blocks, 2 B/param in bf16;
master + m + v of the first ``ram_state_blocks``, 12 B/param, 8 with bf16 state). When that passes
the budget, the state chunk shrinks (down to 1 Mi elements), then parked gradients move to SSD (from
the last block down), then the prefetch depth shrinks (down to 1); the RAM tier is never shrunk: the
pool's reservation then fails naming it.
"""

from __future__ import annotations

import dataclasses

from fuyou.engine.layout import ModelLayout, elem_size
from fuyou.engine.plan import Plan
from fuyou.engine.ram_tier import ram_bytes, rollback_blocks
from fuyou.units import align_up

MIN_CHUNK = 1 << 20


def parked(layout: ModelLayout, plan: Plan) -> range:
    """Blocks whose gradients wait until the step's end (wherever they wait): every block with the
    clipping schedule, RAM-tier blocks 1…R−1 with ``overlap_backward``."""
    if plan.schedule == "overlap_next_forward":
        return range(len(layout.blocks))
    return rollback_blocks(plan.ram_weight_blocks, plan.ram_state_blocks, plan.schedule)


def parked_in_ram(layout: ModelLayout, plan: Plan) -> list[int]:
    """The parked blocks whose gradients wait in host RAM (``Plan.park_ram_blocks``); the rest on SSD."""
    return [b for b in parked(layout, plan) if plan.parks_in_ram(b)]


def host_need(layout: ModelLayout, plan: Plan) -> int:
    """Bytes of host memory ``plan`` reserves for ``layout``: buffers and RAM tier (4 KiB-rounded, as
    the pool counts). Raises ConfigError if the plan's RAM tier names more blocks than ``layout`` has."""
    nb = range(len(layout.blocks))
    w = align_up(max(layout.w(b).nbytes for b in nb), 4096)
    g = align_up(max(layout.numel(b) for b in nb) * elem_size(layout.compute_dtype), 4096)
    need = (plan.prefetch_depth + 1) * w + 2 * g + 2 * w + plan.state_buffers * align_up(layout.state_bytes(), 4096)
    need += sum(align_up(layout.numel(b) * elem_size(layout.compute_dtype), 4096) for b in parked_in_ram(layout, plan))
    return need + sum(ram_bytes(layout, plan.ram_weight_blocks, plan.ram_state_blocks))


def fit_host(layout: ModelLayout, plan: Plan, budget: int, fixed_chunk: bool = False) -> tuple[ModelLayout, Plan]:
    """Shrink the state chunk (unless ``fixed_chunk``: a store's layout), then park gradients on SSD
    (fewer blocks' in RAM), then the prefetch depth, until the host buffers fit ``budget``.

    Returns the (possibly) adjusted layout and plan; if nothing fits, returns the smallest, and the
    pool's reservation then fails with a message naming every buffer class.
    """
    while not fixed_chunk and host_need(layout, plan) > budget and layout.state_chunk > MIN_CHUNK:
        layout = dataclasses.replace(layout, state_chunk=max(MIN_CHUNK, layout.state_chunk // 2))
    if host_need(layout, plan) > budget and parked_in_ram(layout, plan):
        plan = dataclasses.replace(plan, park_ram_blocks=_ram_parks_that_fit(layout, plan, budget))
    while host_need(layout, plan) > budget and plan.prefetch_depth > 1:
        plan = dataclasses.replace(plan, prefetch_depth=plan.prefetch_depth - 1)
    return layout, plan


def _ram_parks_that_fit(layout: ModelLayout, plan: Plan, budget: int) -> int:
    """The largest ``park_ram_blocks`` (≤ the plan's) whose host need fits ``budget``; 0 if none does."""
    n = len(layout.blocks) if plan.park_ram_blocks is None else plan.park_ram_blocks
    while n > 0 and host_need(layout, dataclasses.replace(plan, park_ram_blocks=n)) > budget:
        n -= 1
    return n
