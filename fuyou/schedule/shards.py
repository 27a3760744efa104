"""How a block's flat vectors are split across data-parallel ranks, written once.

With ``world`` ranks every block's flat vector (compute weights, fp32 master, m, v, gradient; the
layout of ``ModelLayout``) is cut into ``world`` contiguous shards of ``shard_len`` elements, the
last one shorter (uneven shards) or empty; the vector is padded with zeros to ``world × shard_len``
elements so that collectives move equal pieces (what NCCL's ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` require). ``shard_len`` is a multiple of ``SHARD_ALIGN`` elements, so every
shard starts 64-byte aligned in bf16 and is a whole number of Adam's 32-element chunk granules.

Rank ``r`` stores and updates only elements ``shard_range(numel, r, world)``; before forward and
backward each block's weights are all-gathered from the ranks' shards, after backward its gradient is
reduce-scattered. A ring all-gather (and reduce-scatter) moves ``(world - 1) × shard_len`` elements
into (out of) each rank: ``collective_bytes``. The planner models these bytes; the engine moves them.
Plain Python, no torch.
"""

from __future__ import annotations

from fuyou.errors import ConfigError

SHARD_ALIGN = 32
"""Elements a shard's length is a multiple of (64 bytes of bf16; Adam's chunks are multiples of 32)."""


def _check(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} of world size {world}: need world ≥ 1 and 0 ≤ rank < world")


def shard_len(numel: int, world: int) -> int:
    """Elements of the largest shard (rank 0's) of a ``numel``-element vector over ``world`` ranks;
    every collective moves pieces of this many elements (``numel`` itself on one rank). Raises
    ConfigError for world < 1."""
    _check(0, world)
    if world == 1:
        return numel
    per = -(-numel // world)
    return -(-per // SHARD_ALIGN) * SHARD_ALIGN


def padded_numel(numel: int, world: int) -> int:
    """Elements of the gathered (zero-padded) vector: ``world × shard_len``."""
    return world * shard_len(numel, world)


def shard_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """Element range [lo, hi) of the vector rank ``rank`` owns (possibly empty for the last ranks of
    a tiny block). Raises ConfigError for a rank outside [0, world)."""
    _check(rank, world)
    s = shard_len(numel, world)
    return min(rank * s, numel), min((rank + 1) * s, numel)


def collective_bytes(numel: int, world: int, elem_bytes: int) -> int:
    """Bytes one ring all-gather (or reduce-scatter) of a ``numel``-element vector moves into (out
    of) each rank: ``(world - 1) × shard_len × elem_bytes``; 0 on one rank."""
    return (world - 1) * shard_len(numel, world) * elem_bytes
