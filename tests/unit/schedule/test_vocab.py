"""The vocabulary split's rule (``fuyou.schedule.vocab``): names, rows, the group count, policies."""

from fuyou.schedule.experts import spread_policies
from fuyou.schedule.vocab import row_ranges, vocab_block_name


def test_names_rows_and_counts():
    assert [vocab_block_name(g) for g in range(3)] == ["embed", "embed.vocab.1", "embed.vocab.2"]
    assert row_ranges(10, 3) == [(0, 3), (3, 6), (6, 10)]


def test_policies_of_the_unsplit_blocks_spread_to_the_vocabulary_groups():
    names = ["embed", "embed.vocab.1", "embed.vocab.2", "layer.0", "head"]
    assert spread_policies(("keep", "recompute", "keep"), names) == ("keep",) * 3 + ("recompute", "keep")
    per_block = ("keep", "swap_cpu", "keep", "recompute", "keep")
    assert spread_policies(per_block, names) == per_block
