"""The data-parallel shard rule (``fuyou.schedule.shards``): disjoint, covering, aligned, equal pieces."""

from __future__ import annotations

import pytest

from fuyou.errors import ConfigError
from fuyou.schedule.shards import SHARD_ALIGN, collective_bytes, padded_numel, shard_len, shard_range


@pytest.mark.parametrize("numel", [0, 1, 31, 32, 33, 1000, 4097, 123_457])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shards_cover_the_vector_once_in_rank_order(numel, world):
    ranges = [shard_range(numel, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    for (lo, hi), (lo2, _) in zip(ranges, ranges[1:]):
        assert lo <= hi == lo2  # contiguous, in rank order, none overlapping
    s = shard_len(numel, world)
    assert all(hi - lo <= s for lo, hi in ranges)
    assert padded_numel(numel, world) == world * s >= numel
    if world > 1:
        assert s % SHARD_ALIGN == 0 and all(lo % SHARD_ALIGN == 0 for lo, hi in ranges if hi > lo)


def test_one_rank_owns_everything_unpadded():
    assert shard_range(1001, 0, 1) == (0, 1001)
    assert shard_len(1001, 1) == padded_numel(1001, 1) == 1001
    assert collective_bytes(1001, 1, 2) == 0


def test_uneven_shards_and_collective_bytes():
    # 100 elements over 3 ranks: pieces of 64 (34 rounded up to 32s), the last rank owns nothing
    assert shard_len(100, 3) == 64
    assert [shard_range(100, r, 3) for r in range(3)] == [(0, 64), (64, 100), (100, 100)]
    assert collective_bytes(100, 3, 2) == 2 * 64 * 2  # two other ranks' pieces, bf16


@pytest.mark.parametrize("rank,world", [(0, 0), (2, 2), (-1, 2)])
def test_bad_rank_or_world_is_refused(rank, world):
    with pytest.raises(ConfigError, match="rank"):
        shard_range(10, rank, world)
