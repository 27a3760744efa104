"""The activation probe (``fuyou.models.activation_probe``): each block's device memory measured on fake
tensors equals the same measurement on real tensors (the plain reference: the same code with real
storage behind every tensor), for every kind of block the probe measures — decoder layers of each
family, a mixture of experts' layer whole and split (its core and an expert group, the fp32 grouped
matmul's rule included), the embedding's context and the head's loss."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from fuyou.models import activation_probe
from fuyou.models.activation_probe import probe_block
from fuyou.models.adapters import make_adapter
from fuyou.models.description import describe_model
from tests.integration.tiny_models import tiny


def _real(monkeypatch: pytest.MonkeyPatch, adapter, b: int, cb: int, seq: int, mb: int):
    """The probe's measurement with real tensors: no fake mode, the same meter."""
    with monkeypatch.context() as m:
        m.setattr(activation_probe, "FakeTensorMode", contextlib.nullcontext)
        return probe_block(adapter, b, cb, seq, mb)


@pytest.mark.parametrize(
    "family, groups",
    [
        *(("llama", 1), ("gpt2", 1), ("gemma2", 1), ("gemma3", 1), ("mixtral", 1), ("qwen3_moe", 2), ("gpt_oss", 2)),
        ("gemma4_moe", 1),  # experts beside the dense MLP, per-kind head sizes
        ("glm_moe_dsa", 2),  # GLM-5: layer 1 (a core and groups) reads the top-k keys layer 0 hands on
        pytest.param("deepseek_v3", 2, marks=pytest.mark.slow),  # latent attention; a dense layer, a core, groups
    ],
)
@pytest.mark.parametrize("cb", [2, 4])
def test_fake_tensors_measure_what_real_ones_allocate(monkeypatch, family, groups, cb):
    cfg, _ = tiny(family, layers=2)
    adapter = make_adapter(cfg, expert_groups=groups)
    for b in range(len(adapter.blocks)):
        fake = probe_block(adapter, b, cb, 16, 3)
        real = _real(monkeypatch, adapter, b, cb, 16, 3)
        assert fake == real, (family, adapter.blocks[b].name)
        measured_kind = b == 0 or b == len(adapter.blocks) - 1 or "layer" in adapter.blocks[b].name
        assert measured_kind == (fake is not None), adapter.blocks[b].name


def test_a_layer_saves_what_autograd_keeps_and_its_transients_grow_with_the_tokens():
    cfg, _ = tiny("llama", layers=1, hidden=64)
    adapter = make_adapter(cfg)
    small, large = probe_block(adapter, 1, 2, 16, 1), probe_block(adapter, 1, 2, 64, 4)
    assert small is not None and large is not None
    # per token, a Llama layer saves its norms' fp32 upcasts, q/k/v/o inputs, the MLP's gate/up/act:
    # more than a few hidden states, and the same per token at any batch (no attention scores: sdpa)
    assert 8 * 64 * 2 < small.saved_per_token == large.saved_per_token
    assert small.fwd_per_token > 0 and small.bwd_per_token > 0 and small.lazy_bwd_per_token > 0


def test_the_description_measures_each_block_kind_once_and_the_rule_stands_in_elsewhere():
    cfg, _ = tiny("qwen2", layers=3)
    shape = describe_model(cfg.to_dict(), vocab_groups=2)
    assert shape.probe is not None
    measured = [shape.probe(b, 2, 16, 2) for b in range(len(shape.blocks))]
    names = [blk.name for blk in shape.blocks]
    # the embedding's later vocabulary group and the split head: the rule (None here)
    assert [m is None for m in measured] == [n.startswith(("embed.vocab", "head")) for n in names]
    layers = [m for m, blk in zip(measured, shape.blocks) if blk.kind == "layer"]
    assert all(m is layers[0] for m in layers)  # one measurement for the three layers
    rule = shape.memory(names.index("embed.vocab.1"), 2, 16, 2)
    assert rule.saved_per_token == 0 and rule.bwd_per_token == 0


def test_a_layer_that_hands_its_top_k_keys_on_holds_them_through_the_step():
    """GLM-5 (``families.HANDED_ON``): layer 0's indexer picks each query's keys and layer 1 reuses them;
    layer 0 leaves its int32 indices (``index_topk`` per token) in the micro-batch's context under every
    policy, layer 2 (whose keys nothing reads) and the reader nothing; each is its own block kind."""
    from fuyou.schedule.device_memory import DeviceBlock, DeviceRun, resident

    cfg, _ = tiny("glm_moe_dsa", layers=3)
    assert cfg.indexer_types == ["full", "shared", "full"]
    shape = describe_model(cfg.to_dict())
    handed = [shape.memory(b, 4, 16, 2).handed_per_token for b in range(1, 4)]
    assert handed == [4 * cfg.index_topk, 0.0, 0.0]
    run = DeviceRun(2, 16, 1, cfg.hidden_size, 4, cfg.vocab_size, 32)
    source = DeviceBlock("layer.0", "layer", 0, 0, shape.memory(1, 4, 16, 2))
    for policy in ("keep", "recompute", "swap_cpu", "recompute_cpu"):
        bare = DeviceBlock("layer.0", "layer", 0, 0, dataclasses.replace(source.mem, handed_per_token=0.0))
        assert resident(source, policy, run) - resident(bare, policy, run) == 32 * 4 * cfg.index_topk
