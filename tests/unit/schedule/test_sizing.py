import pytest

from fuyou.errors import ConfigError
from fuyou.models.blocks import BlockSpec, ParamSpec
from fuyou.models.store_layout import ModelLayout
from fuyou.schedule import rules
from fuyou.schedule.plan import MIN_CHUNK, Plan
from fuyou.schedule.sizing import buffer_classes, device_floor, fit_host, halve_chunk, host_need, ram_tier_bytes

W = 32000 * 512 * 2  # largest bf16 block, 4 KiB aligned already


def footprint():
    blocks = (
        BlockSpec("embed", (ParamSpec("e", (32000, 512)),)),
        BlockSpec("layer.0", (ParamSpec("w", (1024, 1024)),)),
        BlockSpec("head", (ParamSpec("h", (32000, 512)),)),
    )
    return ModelLayout(blocks).footprint()


def test_fit_shrinks_chunk_then_depth_and_never_grows():
    fp, plan = footprint(), Plan(prefetch_depth=3)
    big = host_need(fp, plan)
    assert fit_host(fp, plan, big) == plan
    plan2 = fit_host(fp, plan, big // 2)
    assert plan2.state_chunk < plan.state_chunk and host_need(fp, plan2) <= big // 2
    plan3 = fit_host(fp, plan, 1)
    assert plan3.state_chunk == MIN_CHUNK and plan3.prefetch_depth == 1
    assert fit_host(fp, plan, 1, fixed_chunk=True, fixed_depth=True).state_chunk == plan.state_chunk


def test_halving_keeps_the_chunk_a_multiple_of_32():
    assert halve_chunk(3 * (1 << 20) + 96) % 32 == 0 and halve_chunk(1 << 23) == 1 << 22
    assert halve_chunk(MIN_CHUNK + 32) == MIN_CHUNK


def test_need_counts_every_class():
    fp, plan = footprint(), Plan(prefetch_depth=1, state_buffers=2, state_chunk=1 << 20)
    assert host_need(fp, plan) == 2 * W + 2 * W + 2 * W + 2 * (12 << 20)
    clip = Plan(prefetch_depth=1, schedule="overlap_next_forward", state_chunk=1 << 20)
    assert host_need(fp, clip) == host_need(fp, plan) + 2 * W + 1024 * 1024 * 2
    assert [c.name for c in buffer_classes(fp, clip)] == [
        "weights",
        "grads",
        "state",
        "new-weights",
        "park/0",
        "park/1",
        "park/2",
    ]


def test_ram_tier_counts_page_rounded_extents_in_layout_order():
    fp = footprint()
    tier = Plan(ram_weight_blocks=2, ram_state_blocks=1, state_chunk=1 << 20)
    full, rest = divmod(32000 * 512, 1 << 20)  # 15 full state chunks of the embedding and a 640 Ki rest
    assert ram_tier_bytes(fp, tier) == W + 1024 * 1024 * 2 + full * (12 << 20) + rest * 12
    assert host_need(fp, tier) == host_need(fp, Plan(state_chunk=1 << 20)) + ram_tier_bytes(fp, tier)


def test_fit_parks_gradients_on_ssd_before_shrinking_depth():
    """Clipping parks every block's gradient: a budget short of that moves the last blocks' parks to SSD
    (after the state chunk has shrunk, before the prefetch depth does)."""
    fp = footprint()
    clip = Plan(prefetch_depth=2, schedule="overlap_next_forward", state_chunk=1 << 20)
    budget = host_need(fp, clip) - W  # one large parked gradient too many
    plan2 = fit_host(fp, clip, budget)
    assert plan2.park_ram_blocks == 2 and plan2.prefetch_depth == 2 and host_need(fp, plan2) <= budget
    none_parked = host_need(
        fp, Plan(prefetch_depth=2, schedule="overlap_next_forward", park_ram_blocks=0, state_chunk=1 << 20)
    )
    plan3 = fit_host(fp, clip, none_parked)
    assert plan3.park_ram_blocks == 0 and plan3.prefetch_depth == 2
    plan4 = fit_host(fp, clip, none_parked - W)
    assert plan4.park_ram_blocks == 0 and plan4.prefetch_depth == 1


def test_device_floor_is_the_largest_block_with_what_the_head_borrows():
    fp = footprint()
    assert device_floor(fp) == 2 * W
    blocks = (
        BlockSpec("embed", (ParamSpec("e", (32000, 512)),)),
        BlockSpec("layer.0", (ParamSpec("w", (64, 64)),)),
        BlockSpec("head", (ParamSpec("n", (512,)),), borrows=("embed",)),
    )
    tied = ModelLayout(blocks).footprint()
    assert tied.borrowed == (0,) and device_floor(tied) == 2 * W + 2 * 512 * 2


def test_schedule_resolution_and_parking_rules():
    assert rules.resolve(Plan(), clip=True).schedule == "overlap_next_forward"
    assert rules.resolve(Plan(), clip=False).schedule == "overlap_backward"
    with pytest.raises(ConfigError, match="clipping needs the overlap_next_forward schedule"):
        rules.resolve(Plan(schedule="overlap_backward"), clip=True)
    assert rules.load_order(4, [0]) == [0, 1, 2, 3, 0, 2, 1, 0]
    # the embedding's backward reads no weights unless its forward is recomputed
    kinds = ["embed", "layer", "layer", "head"]
    assert rules.weightless_backward(kinds, Plan()) == {0}  # default: keep the embedding, recompute layers
    assert rules.weightless_backward(kinds, Plan(activation_policy=("recompute",) * 4)) == set()
    assert rules.load_order(4, [0], 1, {0}) == [0, 1, 2, 3, 0, 2, 1]
    tier = Plan(schedule="overlap_backward", ram_weight_blocks=3, ram_state_blocks=1)
    assert list(rules.parked(5, tier)) == [1, 2] == list(rules.held_back(tier))
    clip = Plan(schedule="overlap_next_forward", park_ram_blocks=2, ram_weight_blocks=3)
    assert list(rules.held_back(clip)) == [] and rules.parked_in_ram(4, clip) == [0, 1]
    assert rules.parked_on_ssd(4, clip) == [2, 3]
    with pytest.raises(ConfigError, match="keeps 3 blocks' weights"):
        rules.check_ram_tier(Plan(ram_weight_blocks=3), 2)
