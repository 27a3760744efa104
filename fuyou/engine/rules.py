"""Simple rules that fit a plan into the host budget (the cost-model planner will replace them).

Host memory Fuyou reserves: ``prefetch_depth + 1`` weight buffers (largest block), 2 gradient and
2 new-weight buffers (largest block), ``state_buffers`` optimizer-state chunks, and with the
clipping schedule one parked gradient per block. When that passes the budget, the state chunk
shrinks (down to 1 Mi elements), then the prefetch depth (down to 1).
"""

from __future__ import annotations

import dataclasses

from fuyou.engine.layout import ModelLayout, elem_size
from fuyou.engine.plan import Plan
from fuyou.units import align_up

MIN_CHUNK = 1 << 20


def host_need(layout: ModelLayout, plan: Plan) -> int:
    """Bytes of host buffers ``plan`` reserves for ``layout`` (4 KiB-rounded, as the pool counts)."""
    nb = range(len(layout.blocks))
    w = align_up(max(layout.w(b).nbytes for b in nb), 4096)
    g = align_up(max(layout.numel(b) for b in nb) * elem_size(layout.compute_dtype), 4096)
    need = (plan.prefetch_depth + 1) * w + 2 * g + 2 * w + plan.state_buffers * align_up(layout.state_bytes(), 4096)
    if plan.schedule == "overlap_next_forward":
        need += sum(align_up(layout.numel(b) * elem_size(layout.compute_dtype), 4096) for b in nb)
    return need


def fit_host(layout: ModelLayout, plan: Plan, budget: int, fixed_chunk: bool = False) -> tuple[ModelLayout, Plan]:
    """Shrink the state chunk (unless ``fixed_chunk``: a store's layout), then the prefetch depth,
    until the host buffers fit ``budget``.

    Returns the (possibly) adjusted layout and plan; if nothing fits, returns the smallest, and the
    pool's reservation then fails with a message naming every buffer class.
    """
    while not fixed_chunk and host_need(layout, plan) > budget and layout.state_chunk > MIN_CHUNK:
        layout = dataclasses.replace(layout, state_chunk=max(MIN_CHUNK, layout.state_chunk // 2))
    while host_need(layout, plan) > budget and plan.prefetch_depth > 1:
        plan = dataclasses.replace(plan, prefetch_depth=plan.prefetch_depth - 1)
    return layout, plan
