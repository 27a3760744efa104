"""The one model description (``fuyou.models.description``): the planner's shapes from the model's own
skeleton and the engine's store layout — parameter counts as published, FLOPs as the 6·N rule gives,
frozen parts and expert groups exactly as the engine lays them out."""

from __future__ import annotations

import pytest
import torch

from fuyou.errors import ConfigError
from fuyou.models.adapters import make_adapter
from fuyou.models.description import describe_model, load_description
from fuyou.models.freeze import frozen_keys
from fuyou.models.store_layout import ModelLayout
from fuyou.schedule.shapes import NAMED, BlockShape, ModelShape
from tests.integration.tiny_models import FAMILIES, MOE_FAMILIES, tiny


@pytest.mark.parametrize(
    "name, params",
    [  # the published parameter counts (model cards / safetensors index totals)
        ("llama-2-7b", 6_738_415_616),
        ("llama-3-8b", 8_030_261_248),
        ("mixtral-8x7b", 46_702_792_704),
        ("qwen3-235b-a22b", 235_093_634_560),
    ],
)
def test_named_shapes_have_the_published_parameter_counts(name, params):
    assert load_description(name).params == params


def test_model_flops_are_six_times_the_matmul_parameters():
    """Llama-3-8B: every weight but the embedding and the norms is in a matmul (the untied head too)."""
    c = NAMED["llama-3-8b"]
    h, L, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    matmul = 8_030_261_248 - v * h - (2 * L + 1) * h
    s = load_description("llama-3-8b")
    assert s.train_flops_per_token(0) == 6 * matmul
    assert s.train_flops_per_token(1024) == 6 * matmul + 12 * L * h * 1024


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=pytest.mark.slow) if f in ("glm4_moe", "llama4", "qwen3_5_moe", "qwen3_next") else f
        for f in FAMILIES
    ],
)
def test_blocks_are_the_engines_own(family):
    """Names, elements and FLOPs per block are the adapter's blocks and the store layout's, split or not;
    the largest weight tensor is backward's fixed transient."""
    cfg, _ = tiny(family, hidden=72)
    moe = family in MOE_FAMILIES
    for groups in (1, 2, 3) if moe else (1,):
        ad = make_adapter(cfg, expert_groups=groups)
        lay = ModelLayout(tuple(ad.blocks), frozen_params=frozen_keys(tuple(ad.blocks), ()))  # buffers: read-only
        s = describe_model(cfg).split(groups) if moe else describe_model(cfg)
        assert [b.name for b in s.blocks] == [b.name for b in ad.blocks]
        assert [b.numel for b in s.blocks] == [lay.numel(b) for b in range(len(ad.blocks))]
        assert [b.matmul_flops_per_token for b in s.blocks] == [b.flops_per_token for b in ad.blocks]
        for blk, spec in zip(s.blocks, ad.blocks):
            if blk.kind in ("layer", "experts"):
                assert blk.bwd_fixed_elems == max(p.numel for p in spec.params)


def test_phi3s_fused_gate_up_is_its_largest_gradient():
    cfg, _ = tiny("phi3", hidden=64)
    layer = describe_model(cfg).blocks[1]
    assert layer.bwd_fixed_elems == 2 * cfg.intermediate_size * cfg.hidden_size


def test_freeze_patterns_give_the_layouts_read_only_parts():
    cfg, _ = tiny("llama", hidden=64)
    patterns = ("*.self_attn.q_proj.weight", "model.embed_tokens.*")
    s = describe_model(cfg, freeze=patterns)
    blocks = tuple(make_adapter(cfg).blocks)
    lay = ModelLayout(blocks, frozen_blocks=frozenset({0}), frozen_params=frozen_keys(blocks, patterns))
    assert [b.frozen for b in s.blocks] == [True, False, False, False]
    assert [b.frozen_numel for b in s.blocks[1:]] == [lay.frozen_numel(b) for b in range(1, len(blocks))]
    assert s.blocks[1].frozen_numel == cfg.hidden_size**2
    with pytest.raises(ConfigError, match="matches no parameter"):
        describe_model(cfg, freeze=("nothing.*",))


def test_refusals_are_one_line():
    cfg, _ = tiny("gpt2", hidden=64)
    with pytest.raises(ConfigError, match="no experts"):
        describe_model(cfg, expert_groups=2)
    with pytest.raises(ConfigError, match="cannot be split into vocabulary groups"):
        describe_model(cfg).split_vocab(2)
    with pytest.raises(ConfigError, match="names no model_type"):
        describe_model({"hidden_size": 8})
    hand = ModelShape("hand", (BlockShape("embed", "embed", 8, 0),), 8, 0, 4, experts=4)
    with pytest.raises(ConfigError, match="not described from a model config"):
        hand.split(2)


@pytest.mark.parametrize(
    "family",
    ["llama", "deepseek_v3", *(pytest.param(f, marks=pytest.mark.slow) for f in ("gpt2", "qwen2", "glm4_moe"))],
)
def test_a_dense_layers_forward_flops_are_what_torch_counts(family):
    """A dense decoder layer's forward FLOPs per token (matmuls + attention, no causal halving) equal
    ``torch.utils.flop_counter``'s count of the library's own layer at 16 and 64 positions: multi-head
    latent attention's wider heads (DeepSeek-V3: queries and keys 16 wide, values 16, over 4 heads of
    a 64 hidden), GLM-4.5's partial rotary and a head_dim times heads that is the hidden."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg, model = tiny(family, layers=2)
    shape = describe_model(cfg)
    model.set_attn_implementation("eager")  # its QKᵀ and AV are matmuls the counter sees (CPU sdpa is not)
    layer = shape.blocks[1]  # layer 0: dense in every family here (DeepSeek-V3, GLM-4.5: first_k_dense_replace)
    for seq in (16, 64):
        ids = torch.randint(0, cfg.vocab_size, (2, seq))
        with torch.no_grad():
            hidden = model.get_input_embeddings()(ids)
            counter = FlopCounterMode(display=False)
            first = model.transformer.h[0] if family == "gpt2" else model.model.layers[0]
            with counter:
                if family == "gpt2":
                    first(hidden)
                else:
                    pos = torch.arange(seq)[None].expand(2, -1)
                    first(hidden, position_embeddings=model.model.rotary_emb(hidden, pos), position_ids=pos)
        assert layer.fwd_flops_per_token(shape.hidden, seq) * 2 * seq == counter.get_total_flops(), seq


def test_sliding_layers_count_their_window_and_latent_attention_its_width():
    cfg, _ = tiny("gpt_oss", layers=2)  # alternating 4-token windows and full attention
    a, b = [blk for blk in describe_model(cfg).blocks if blk.kind == "layer"]
    assert (a.window, b.window) == (4, 0) and a.attn_flops(cfg.hidden_size, 16) * 4 == b.attn_flops(cfg.hidden_size, 16)
    big = describe_model(load_description("deepseek-v3-671b").source)
    layer = next(blk for blk in big.blocks if blk.kind == "layer")
    assert layer.attn_flops_per_key == 2 * 128 * (192 + 128)  # 128 heads, 192-wide queries and keys, 128-wide values


def test_experts_that_run_every_expert_count_them_all_and_are_never_split(monkeypatch):
    """transformers' own Llama 4 runs every expert on every token (unrouted ones scaled by zero); Fuyou
    routes it (``fuyou.models.llama4``): top-1 FLOPs, and its layers split. An experts module that runs
    them all (Llama 4's as transformers has it) counts all their FLOPs and is never split."""
    from fuyou.models import adapters

    cfg, _ = tiny("llama4", layers=2)
    fused = [p for p in make_adapter(cfg).blocks[2].params if len(p.shape) == 3]  # layer 1: experts
    per_expert = 2 * sum(p.numel for p in fused) // cfg.num_local_experts
    routed = make_adapter(cfg)
    assert not routed.dense_experts and len(make_adapter(cfg, expert_groups=2).blocks) == len(routed.blocks) + 2
    monkeypatch.setattr(adapters, "route_experts", lambda model, config: None)  # transformers' Llama 4 as it is
    dense = make_adapter(cfg)
    assert dense.dense_experts
    assert dense.blocks[2].flops_per_token - routed.blocks[2].flops_per_token == (4 - 1) * per_expert
    with pytest.raises(ConfigError, match="run every expert on every token.*cannot be split into 2 expert groups"):
        make_adapter(cfg, expert_groups=2)
