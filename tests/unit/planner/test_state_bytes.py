"""The planner counts each optimizer-state format's SSD bytes per parameter per step as the format defines
them (``fuyou.schedule.state_format``): Adam's reads and writes, plus the backward's re-read of the weights."""

from __future__ import annotations

import pytest

from fuyou.models.description import describe_model
from fuyou.planner.cluster import Cluster
from fuyou.planner.cost import predict
from fuyou.planner.graph import StepConfig
from fuyou.schedule.plan import Plan
from fuyou.schedule.state_format import FORMATS
from tests.integration.tiny_models import tiny
from tests.unit.planner.helpers import profile


@pytest.mark.parametrize("fmt", ["fp32", "split", "bf16", "fp32-bf16"])
@pytest.mark.parametrize("cb", [2, 4])
def test_bytes_per_parameter_follow_the_format(fmt: str, cb: int) -> None:
    cfg, _ = tiny("llama", layers=2)
    shape = describe_model(cfg)
    n = sum(b.numel for b in shape.blocks)
    plan = Plan(  # clipping's schedule, nothing in RAM, gradients parked in host memory, no activation traffic
        ram_weight_blocks=0, ram_state_blocks=0, schedule="overlap_next_forward", activation_policy=("keep",) * 4
    )
    f = FORMATS[fmt]
    p = predict(shape, plan, StepConfig(1, 16, f.state_bytes(cb), cb, Cluster(1), optimizer_state=fmt), profile())
    assert p.ssd_write_bytes == f.adam_written(cb) * n
    assert p.ssd_read_bytes == (f.adam_read(cb) + cb) * n  # the backward re-reads the weights
    if fmt == "fp32":  # today's figure: 28 B/param in bf16
        assert p.ssd_read_bytes + p.ssd_write_bytes == {2: 28, 4: 32}[cb] * n
