"""The device floor leaves room for what CUDA's libraries take from the capped allocator."""

import pytest

from fuyou.engine.assembly import admit
from fuyou.errors import DeviceMemoryError
from fuyou.models.blocks import BlockSpec, ParamSpec
from fuyou.models.store_layout import ModelLayout
from fuyou.schedule import sizing
from fuyou.schedule.plan import Plan


def layout() -> ModelLayout:
    return ModelLayout(
        (
            BlockSpec("embed", (ParamSpec("e", (1000, 256)),)),
            BlockSpec("layer.0", (ParamSpec("w", (512, 512)),)),
            BlockSpec("head", (ParamSpec("h", (1000, 256)),)),
        )
    )


def test_cuda_floor_adds_the_library_workspace_once():
    fp = layout().footprint()
    assert (
        sizing.library_bytes("cpu") == 0
        and sizing.library_bytes("cuda") == sizing.CUDA_LIBRARY_BYTES + sizing.ALLOCATOR_ROUNDING_BYTES > 0
    )
    assert sizing.device_floor(fp, "cuda") == sizing.device_floor(fp) + sizing.library_bytes("cuda")


def test_admit_refuses_a_cuda_cap_that_leaves_no_room_for_the_workspace():
    lay = layout()
    floor = sizing.device_floor(lay.footprint())
    plan = Plan(state_chunk=lay.state_chunk)
    assert admit(lay, plan, 1 << 30, floor, device="cpu").prefetch_depth == plan.prefetch_depth
    with pytest.raises(DeviceMemoryError) as e:
        admit(lay, plan, 1 << 30, floor + (1 << 20), device="cuda")
    msg = str(e.value)
    assert "\n" not in msg and "cuBLAS workspace" in msg and "--gpu-memory" in msg
    admit(lay, plan, 1 << 30, sizing.device_floor(lay.footprint(), "cuda"), device="cuda")
