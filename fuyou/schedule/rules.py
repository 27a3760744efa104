"""The step's rules, written once: which schedule runs, the order blocks are loaded in (and which blocks'
backward reads no weights), which blocks' gradients wait (park) until the step's end, and where they wait. The engine follows them
(``fuyou/engine/step.py``); the planner's step graph (``fuyou/planner/graph.py``) builds its
operations from them. Plain Python, no torch.

Blocks are numbered in layout order: 0 the embedding, 1…H−1 the decoder layers, H the head (with an
embedding and head split by vocabulary rows, ``fuyou.schedule.vocab``: the embedding's groups first, the
head's F…H last).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from fuyou.errors import ConfigError
from fuyou.schedule.experts import EXPERTS_PART
from fuyou.schedule.plan import AUTO, RECOMPUTES, Plan
from fuyou.schedule.vocab import EMBED, HEAD


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


def load_order(nblocks: int, borrowed: list[int], heads: int = 1, weightless: Collection[int] = ()) -> list[int]:
    """Blocks in the order one training step loads their weights: forward 0…F−1, the head F…H (its
    ``heads`` vocabulary groups, ``fuyou.schedule.vocab``; one: F = H), the blocks the head borrows (a
    tied embedding), the head groups again but the last, in reverse, for the loss's backward pass
    (H−1…F), then backward F−1…0 but the ``weightless`` blocks (``weightless_backward``)."""
    H, F = nblocks - 1, nblocks - heads
    back = [b for b in range(F - 1, -1, -1) if b not in weightless]
    return list(range(H)) + [H] + list(borrowed) + list(range(H - 1, F - 1, -1)) + back


def block_kind(name: str, b: int, first_head: int) -> str:
    """``embed`` | ``layer`` | ``experts`` | ``head`` of block ``b`` named ``name`` (layout order; the head's
    vocabulary groups start at ``first_head``)."""
    if b >= first_head:
        return "head"
    if name.startswith(EMBED):
        return "embed"
    return "experts" if EXPERTS_PART in name else "layer"


def reads_weights_in_backward(kind: str, policy: str) -> bool:
    """Whether a block's backward needs its weights on the device. Not an embedding's (or one of its
    vocabulary groups') whose forward graph was kept: a lookup's weight gradient is a scatter of the
    tokens' rows, which reads no weight (autograd keeps the ids and the row count), and the scaled
    embeddings (Gemma) scale by a constant. Recomputed, its forward reads them again."""
    return kind != "embed" or policy in RECOMPUTES


def weightless_backward(kinds: Sequence[str], plan: Plan) -> frozenset[int]:
    """The blocks (of ``kinds``, layout order: ``block_kind``) whose backward under ``plan`` loads no weights
    (``reads_weights_in_backward``): the step leaves them out of its load order's backward."""
    n = len(kinds)
    return frozenset(b for b, k in enumerate(kinds) if not reads_weights_in_backward(k, plan.policy(b, n)))


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
