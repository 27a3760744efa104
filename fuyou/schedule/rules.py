"""The step's rules, written once: which schedule runs, the order blocks are loaded in, which blocks'
gradients wait (park) until the step's end, and where they wait. The engine follows them
(``fuyou/engine/step.py``); the planner's step graph (``fuyou/planner/graph.py``) builds its
operations from them. Plain Python, no torch.

Blocks are numbered in layout order: 0 the embedding, 1…H−1 the decoder layers, H the head (with an
embedding and head split by vocabulary rows, ``fuyou.schedule.vocab``: the embedding's groups first, the
head's F…H last).
"""

from __future__ import annotations

import dataclasses

from fuyou.errors import ConfigError
from fuyou.schedule.plan import AUTO, Plan
from fuyou.schedule.vocab import HEAD


def resolve(plan: Plan, clip: bool) -> Plan:
    """``plan`` with a concrete schedule: ``auto`` becomes ``overlap_next_forward`` when clipping
    (``clip``: a max grad norm is set), else ``overlap_backward``.

    Raises ConfigError for ``overlap_backward`` with clipping: the global norm is known only after
    backward, when ``overlap_backward`` has already applied most updates.
    """
    if plan.schedule == AUTO:
        return dataclasses.replace(plan, schedule="overlap_next_forward" if clip else "overlap_backward")
    if clip and plan.schedule == "overlap_backward":
        raise ConfigError(
            "clipping needs the overlap_next_forward schedule (the global norm is known only after "
            "backward); drop the plan's schedule (auto) or set --max-grad-norm 0"
        )
    return plan


def load_order(nblocks: int, borrowed: list[int], heads: int = 1) -> list[int]:
    """Blocks in the order one training step loads their weights: forward 0…F−1, the head F…H (its
    ``heads`` vocabulary groups, ``fuyou.schedule.vocab``; one: F = H), the blocks the head borrows (a
    tied embedding), the head groups again but the last, in reverse, for the loss's backward pass
    (H−1…F), then backward F−1…0."""
    H, F = nblocks - 1, nblocks - heads
    return list(range(H)) + [H] + list(borrowed) + list(range(H - 1, F - 1, -1)) + list(range(F - 1, -1, -1))


def eval_order(nblocks: int, borrowed: list[int]) -> list[int]:
    """Blocks in the order a forward-only evaluation loads them: 0…H, then the head's borrowed blocks."""
    return list(range(nblocks)) + list(borrowed)


def head_count(names: list[str]) -> int:
    """How many of the blocks ``names`` (layout order) are the head's vocabulary groups: the last
    ``head`` and the ``head.vocab.<g>`` after it (``fuyou.schedule.vocab``)."""
    return len(names) - names.index(HEAD) if HEAD in names else 1


def held_back(plan: Plan) -> range:
    """Blocks whose gradients ``overlap_backward`` holds until the whole backward proved finite.

    A non-finite gradient rolls the step back with ``store.abort``, which cannot undo RAM writes; so
    RAM-tier blocks 1…R−1 (R = the larger RAM-tier count) are updated only after block 0's backward.
    Block 0 is the last gradient: it never waits. Empty for the clipping schedule (it parks all).
    """
    if plan.schedule != "overlap_backward":
        return range(0)
    return range(1, max(plan.ram_weight_blocks, plan.ram_state_blocks))


def parked(nblocks: int, plan: Plan) -> range:
    """Blocks whose gradients wait until the step's end (wherever they wait): every block with the
    clipping schedule, the held-back RAM-tier blocks with ``overlap_backward``."""
    return range(nblocks) if plan.clips else held_back(plan)


def parked_in_ram(nblocks: int, plan: Plan) -> list[int]:
    """Parked blocks whose gradients wait in host RAM (``Plan.park_ram_blocks``); the rest on SSD."""
    return [b for b in parked(nblocks, plan) if plan.parks_in_ram(b)]


def parked_on_ssd(nblocks: int, plan: Plan) -> list[int]:
    """Parked blocks whose gradients are written to SSD and read back before their update."""
    return [b for b in parked(nblocks, plan) if not plan.parks_in_ram(b)]


def check_ram_tier(plan: Plan, nblocks: int) -> None:
    """Raises ConfigError if the plan's RAM tier names more blocks than the model has."""
    if max(plan.ram_weight_blocks, plan.ram_state_blocks) > nblocks:
        raise ConfigError(
            f"the plan keeps {plan.ram_weight_blocks} blocks' weights and {plan.ram_state_blocks} "
            f"blocks' optimizer state in host RAM, but the model has {nblocks} blocks"
        )
