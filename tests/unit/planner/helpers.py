"""Small shapes and profiles for planner tests (no torch)."""

from __future__ import annotations

from fuyou.models.description import describe_model
from fuyou.planner.profile import HardwareProfile
from fuyou.schedule.shapes import BlockShape, ModelShape

FAST = 1e18  # a rate so high its durations vanish


def toy_shape(n0: int = 1 << 20, n1: int = 1 << 22, n2: int = 1 << 20, act: int = 1000) -> ModelShape:
    """embed, one layer, head; FLOPs/token chosen so times are round numbers."""
    return ModelShape(
        "toy",
        (
            BlockShape("embed", "embed", n0, 0),
            BlockShape("layer.0", "layer", n1, 10**9, act),
            BlockShape("head", "head", n2, 10**9),
        ),
        hidden=8,
        layers=1,
        vocab=16,
    )


def profile(**kw: float) -> HardwareProfile:
    """A cuda profile where everything is instant unless set in ``kw``."""
    base = dict(
        name="toy",
        device="cuda",
        ssd_read_Bps=FAST,
        ssd_write_Bps=FAST,
        adam_params_per_s=FAST,
        h2d_Bps=FAST,
        d2h_Bps=FAST,
        pageable_Bps=FAST,
        host_mem_Bps=FAST,
        device_mem_Bps=FAST,
        device_peak_flops=FAST,
        flops_efficiency=1.0,
        flops_half_tokens=0,
        commit_s=0.0,
    )
    base.update(kw)
    return HardwareProfile(**base)


def small_llama() -> ModelShape:
    """A ~120M-parameter Llama shape: 8 layers, hidden 768."""
    return describe_model(
        {
            "model_type": "llama",
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 8,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
        },
        "small",
    )
