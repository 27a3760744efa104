"""How a mixture-of-experts layer's experts are cut into groups, and the refusals around it."""

from __future__ import annotations

import pytest

from fuyou.errors import ConfigError
from fuyou.models.blocks import BlockSpec, ParamSpec, parse_slice, slice_key, split_experts
from fuyou.schedule.experts import expert_group_options, group_ranges, spread_policies
from fuyou.schedule.plan import Plan


@pytest.mark.parametrize("experts", [1, 2, 3, 8, 60, 128])
def test_every_option_cuts_the_experts_into_contiguous_near_equal_groups(experts):
    options = expert_group_options(experts)
    assert options[0] == 1 and options[-1] == experts and options == sorted(set(options))
    for g in options:
        ranges = group_ranges(experts, g)
        assert ranges[0][0] == 0 and ranges[-1][1] == experts and len(ranges) == g
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [hi - lo for lo, hi in ranges]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_slice_keys_round_trip():
    key = "model.layers.3.mlp.experts.gate_up_proj"
    assert parse_slice(slice_key(key, 2, 5)) == (key, 2, 5)
    assert parse_slice(key) is None


def test_split_blocks_keep_every_parameter_and_flop():
    layer = BlockSpec(
        "layer.0",
        (ParamSpec("a.weight", (16, 8)), ParamSpec("m.experts.up", (6, 4, 8)), ParamSpec("m.experts.down", (6, 8, 4))),
        (),
        2 * 16 * 8 + 2 * 2 * (6 * 32 * 2) // 6,
    )
    blocks = split_experts((layer,), 4, experts=6, top_k=2)
    assert [b.name for b in blocks] == ["layer.0"] + [f"layer.0.experts.{g}" for g in range(4)]
    assert sum(b.numel for b in blocks) == layer.numel
    assert sum(b.flops_per_token for b in blocks) == layer.flops_per_token
    assert blocks[2].params[0] == ParamSpec("m.experts.up[1:3]", (2, 4, 8))
    with pytest.raises(ValueError, match="7 groups"):
        split_experts((layer,), 7, experts=6, top_k=2)


def test_rows_beyond_the_experts_go_to_the_last_group():
    """LongCat-Flash's ``gate_up_proj`` has a row per zero-computation expert too (``extra_rows``), which no
    expert reads: the last group holds them; ``down_proj`` and the FLOPs split by the experts alone."""
    up, down = ParamSpec("m.experts.gate_up_proj", (6, 4, 8)), ParamSpec("m.experts.down_proj", (4, 8, 2))
    layer = BlockSpec("layer.0", (ParamSpec("a.weight", (16, 8)), up, down), (), 2 * 16 * 8 + 2 * 2 * (32 + 16))
    blocks = split_experts((layer,), 2, experts=4, top_k=2, extra_rows=2)
    assert [p.key for b in blocks[1:] for p in b.params] == [
        "m.experts.gate_up_proj[0:2]", "m.experts.down_proj[0:2]", "m.experts.gate_up_proj[2:6]", "m.experts.down_proj[2:4]",
    ]  # fmt: skip
    assert sum(b.numel for b in blocks) == layer.numel
    assert sum(b.flops_per_token for b in blocks) == layer.flops_per_token
    assert blocks[1].flops_per_token == blocks[2].flops_per_token


def test_policies_for_the_unsplit_blocks_spread_over_the_groups():
    names = ["embed", "layer.0", "layer.0.experts.0", "layer.0.experts.1", "layer.1", "head"]
    assert spread_policies(("keep", "swap_cpu", "recompute", "keep"), names) == (
        "keep", "swap_cpu", "swap_cpu", "swap_cpu", "recompute", "keep",
    )  # fmt: skip
    assert spread_policies((), names) == ()
    wrong = ("keep", "recompute", "keep")
    assert spread_policies(wrong, names) == wrong  # a wrong count is left for Plan.policy to refuse


def test_refusals():
    from fuyou.models.adapters import make_adapter
    from tests.integration.tiny_models import tiny

    with pytest.raises(ConfigError, match="expert_groups"):
        Plan(expert_groups=-1)
    with pytest.raises(ConfigError, match="no experts to split"):
        make_adapter(tiny("llama")[0], expert_groups=2)
    with pytest.raises(ConfigError, match="4 experts .* into 5 groups"):
        make_adapter(tiny("mixtral")[0], expert_groups=5)
