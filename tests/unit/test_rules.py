from fuyou.engine.layout import ModelLayout
from fuyou.engine.plan import Plan
from fuyou.engine.rules import MIN_CHUNK, fit_host, host_need
from fuyou.models.blocks import BlockSpec, ParamSpec


def layout(chunk=1 << 23):
    blocks = (BlockSpec("embed", (ParamSpec("e", (32000, 512)),)),
              BlockSpec("layer.0", (ParamSpec("w", (1024, 1024)),)),
              BlockSpec("head", (ParamSpec("h", (32000, 512)),)))
    return ModelLayout(blocks, state_chunk=chunk)


def test_fit_shrinks_chunk_then_depth_and_never_grows():
    lay, plan = layout(), Plan(prefetch_depth=3)
    big = host_need(lay, plan)
    assert fit_host(lay, plan, big) == (lay, plan)
    lay2, plan2 = fit_host(lay, plan, big // 2)
    assert lay2.state_chunk < lay.state_chunk and host_need(lay2, plan2) <= big // 2
    lay3, plan3 = fit_host(lay, plan, 1)
    assert lay3.state_chunk == MIN_CHUNK and plan3.prefetch_depth == 1


def test_need_counts_every_class():
    lay, plan = layout(chunk=1 << 20), Plan(prefetch_depth=1, state_buffers=2)
    w = 32000 * 512 * 2  # largest bf16 block, 4 KiB aligned already
    assert host_need(lay, plan) == 2 * w + 2 * w + 2 * w + 2 * (12 << 20)
    clip = Plan(prefetch_depth=1, schedule="overlap_next_forward")
    assert host_need(lay, clip) == host_need(lay, plan) + 2 * w + 1024 * 1024 * 2


def test_fit_parks_gradients_on_ssd_before_shrinking_depth():
    """Clipping parks every block's gradient: a budget short of that moves the last blocks' parks to SSD
    (after the state chunk has shrunk, before the prefetch depth does)."""
    lay = layout(chunk=1 << 20)
    clip = Plan(prefetch_depth=2, schedule="overlap_next_forward")
    w = 32000 * 512 * 2
    budget = host_need(lay, clip) - w  # one large parked gradient too many
    lay2, plan2 = fit_host(lay, clip, budget)
    assert plan2.park_ram_blocks == 2 and plan2.prefetch_depth == 2 and host_need(lay2, plan2) <= budget
    none_parked = host_need(lay, Plan(prefetch_depth=2, schedule="overlap_next_forward", park_ram_blocks=0))
    lay3, plan3 = fit_host(lay, clip, none_parked)
    assert plan3.park_ram_blocks == 0 and plan3.prefetch_depth == 2
    _, plan4 = fit_host(lay, clip, none_parked - w)
    assert plan4.park_ram_blocks == 0 and plan4.prefetch_depth == 1
