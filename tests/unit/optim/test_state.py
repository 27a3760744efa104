"""Per-layer state layout: aligned slots, one extent per layer, zero padding that stays zero."""

from __future__ import annotations

import pytest
import torch

from fuyou.errors import ConfigError
from fuyou.optim import (
    ALIGN_BYTES,
    ALIGN_ELEMS,
    OptimBufferError,
    adamw_step,
    init_state_extent,
    layer_layout,
)

PARAMS = [("q.weight", (48, 64)), ("norm.weight", (7,)), ("bias", (1,)), ("mlp.weight", (33, 5))]


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in PARAMS}


@pytest.mark.parametrize("state_dtype,moment_size", [("fp32", 4), ("bf16", 2)])
def test_layout_sizes_and_alignment(state_dtype: str, moment_size: int) -> None:
    lay = layer_layout(PARAMS, state_dtype)
    assert [s.offset for s in lay.slots] == [0, 3072, 3104, 3136]
    assert lay.numel == 3136 + 192  # 165 elements rounded up to 32
    assert all(s.offset % ALIGN_ELEMS == 0 for s in lay.slots)
    assert lay.master_bytes == lay.numel * 4 and lay.moment_bytes == lay.numel * moment_size
    assert lay.nbytes == lay.master_bytes + 2 * lay.moment_bytes
    assert lay.m_offset % ALIGN_BYTES == 0 and lay.v_offset % ALIGN_BYTES == 0
    assert lay.bf16_bytes == lay.numel * 2


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_extent_views_and_param_views_round_trip(state_dtype: str) -> None:
    lay = layer_layout(PARAMS, state_dtype)
    w = weights()
    extent = init_state_extent(lay, w)
    assert extent.data_ptr() % ALIGN_BYTES == 0 and extent.numel() == lay.nbytes
    master, m, v = lay.views(extent)
    assert m.dtype == v.dtype == lay.state_torch_dtype
    for name, t in lay.param_views(master).items():
        assert torch.equal(t, w[name])
    assert not m.any() and not v.any()
    master.add_(1.0)  # the views share the extent's bytes
    assert torch.equal(lay.views(extent)[0], master)


def test_padding_stays_zero_under_adam() -> None:
    lay = layer_layout(PARAMS)
    extent = init_state_extent(lay, weights())
    master, m, v = lay.views(extent)
    grad = lay.flatten(weights(seed=1), torch.bfloat16)
    pad = torch.ones(lay.numel, dtype=torch.bool)
    for s in lay.slots:
        pad[s.offset : s.offset + s.numel] = False
    for step in range(1, 4):
        adamw_step(master, m, v, grad, lr=1e-2, step=step)
    assert pad.sum() > 0
    assert not master[pad].any() and not m[pad].any() and not v[pad].any()
    assert master[~pad].ne(lay.flatten(weights(), torch.float32)[~pad]).all()


def test_layout_errors() -> None:
    with pytest.raises(ConfigError, match="twice"):
        layer_layout([("a", (2,)), ("a", (3,))])
    with pytest.raises(ConfigError, match="state_dtype"):
        layer_layout(PARAMS, "fp16")
    lay = layer_layout(PARAMS)
    with pytest.raises(ConfigError, match="missing or extra"):
        lay.flatten({"q.weight": torch.zeros(48, 64)}, torch.float32)
    with pytest.raises(OptimBufferError, match="bytes"):
        lay.views(torch.zeros(lay.nbytes - 64, dtype=torch.uint8))
    raw = torch.zeros(lay.nbytes + 64, dtype=torch.uint8)
    k = 1 if raw.data_ptr() % ALIGN_BYTES == 0 else 0  # a start that is not 64-byte aligned
    with pytest.raises(OptimBufferError, match="aligned"):
        lay.views(raw[k : k + lay.nbytes])
