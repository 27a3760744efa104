"""The planner counts each optimizer-state format's SSD bytes per parameter per step as the format defines
them (``fuyou.schedule.state_format``): Adam's reads and writes, plus the backward's re-read of the weights
(not the embedding's: its backward reads none)."""

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


@pytest.mark.parametrize("fmt", ["fp32", "split", "bf16", "fp32-bf16"])  # int8: test_optimizer_state (exact bytes)
@pytest.mark.parametrize("cb", [2, 4])
def test_bytes_per_parameter_follow_the_format(fmt: str, cb: int) -> None:
    cfg, _ = tiny("llama", layers=2)
    shape = describe_model(cfg)
    n = sum(b.numel for b in shape.blocks)
    plan = Plan(  # clipping's schedule, nothing in RAM, gradients parked in host memory, no activation traffic
        ram_weight_blocks=0, ram_state_blocks=0, schedule="overlap_next_forward", activation_policy=("keep",) * 4
    )
    f = FORMATS[fmt]
    p = predict(shape, plan, StepConfig(1, 16, cb, Cluster(1), optimizer_state=fmt), profile())
    assert p.ssd_write_bytes == f.adam_written(cb) * n
    # the backward re-reads the weights but the head's, read once for its turnaround (handed over from
    # Adam), and the embedding's, whose backward reads none
    head, embed = shape.blocks[-1].numel, shape.blocks[0].numel
    assert p.ssd_read_bytes == f.adam_read(cb) * n + cb * (n - head - embed)
    if fmt == "fp32":  # the figure: 28 B/param in bf16, the head's and the embedding's re-reads aside
        assert p.ssd_read_bytes + p.ssd_write_bytes == {2: 28, 4: 32}[cb] * n - cb * (head + embed)


@pytest.mark.parametrize("measured", [2e8, 0.0])
def test_8bit_moments_are_updated_at_their_own_measured_rate(measured: float) -> None:
    """``int8`` updates run at the profile's ``adam_int8_params_per_s`` (0: ``INT8_ADAM_SHARE`` of the fp32 rate);
    the other formats at ``adam_params_per_s``."""
    from fuyou.planner.profile import INT8_ADAM_SHARE

    cfg, _ = tiny("llama", layers=2)
    shape = describe_model(cfg)
    n = sum(b.numel for b in shape.blocks)
    plan = Plan(ram_weight_blocks=0, ram_state_blocks=0, schedule="overlap_next_forward")
    prof = profile(adam_params_per_s=1e9, adam_int8_params_per_s=measured)
    busy = {
        fmt: predict(shape, plan, StepConfig(1, 16, 2, Cluster(1), optimizer_state=fmt), prof).busy_s["adam"]
        for fmt in ("split", "int8")
    }
    assert busy["split"] == pytest.approx(n / 1e9)
    assert busy["int8"] == pytest.approx(n / (measured or INT8_ADAM_SHARE * 1e9))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_chunks_bytes_are_the_stores(fmt: str) -> None:
    """``StateFormat.chunk_bytes`` (what the planner and host sizing count) is the size of the extent the store
    lays out from ``StateFormat.parts`` (64-byte aligned tensors), and ``block_bytes`` the sum over a block's
    chunks."""
    from fuyou.schedule.sizing import state_chunks
    from fuyou.storage.extents import ExtentSpec, TensorSpec, dtype_from_name

    f = FORMATS[fmt]
    for cb in (2, 4):
        for n in (0, 1, 255, 256, 257, 4099):
            ext = ExtentSpec("s", tuple(TensorSpec(k, (m,), dtype_from_name(dt)) for k, m, dt in f.parts(n, cb)))
            assert f.chunk_bytes(n, cb) == ext.nbytes, (cb, n)
        for numel, chunk in ((0, 256), (1000, 256), (4099, 1024), (1 << 20, 1 << 18)):
            assert f.block_bytes(numel, chunk, cb) == sum(
                f.chunk_bytes(b - a, cb) for a, b in state_chunks(numel, chunk)
            )
