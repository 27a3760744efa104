"""The planner's shapes of an embedding split by vocabulary rows (``Plan.vocab_groups``) agree with
the engine's layout, the planner plans them, and what remains of the issue's host floor is said."""

from __future__ import annotations

import dataclasses

import pytest

from fuyou.errors import ConfigError
from fuyou.models.description import describe_model
from fuyou.planner.search import Budgets, Request, search
from fuyou.schedule import sizing
from fuyou.schedule.plan import Plan
from fuyou.schedule.state_format import FORMATS
from tests.unit.planner.helpers import profile

MiB, GiB = 1 << 20, 1 << 30


def test_split_shapes_match_the_engines_layout():
    import torch

    from fuyou.models.adapters import make_adapter
    from fuyou.models.store_layout import ModelLayout
    from tests.integration.tiny_models import tiny

    for fam in ("llama", "qwen2", "phi3", "mixtral"):
        cfg, _ = tiny(fam, hidden=72)
        s = describe_model(cfg)
        for g in (2, 3, 5):
            ad, split = make_adapter(cfg, vocab_groups=g), s.split_vocab(g)
            lay = ModelLayout(tuple(ad.blocks))
            assert [b.name for b in split.blocks] == [b.name for b in ad.blocks]
            assert [b.numel for b in split.blocks] == [lay.numel(b) for b in range(len(ad.blocks))]
            assert [b.matmul_flops_per_token for b in split.blocks] == [b.flops_per_token for b in ad.blocks]
            assert [b.keeps_input for b in split.blocks[:g]] == [True] + [False] * (g - 1)
            assert [ad.additive(b) for b in range(g)] == [False] + [True] * (g - 1)
            assert ModelLayout(tuple(ad.blocks)).footprint() == split.footprint(2, FORMATS["fp32"])
            fp32 = ModelLayout(tuple(ad.blocks), torch.float32).footprint()
            assert all(e <= p for e, p in zip(fp32.weight_bytes, split.footprint(4, FORMATS["fp32"]).weight_bytes))
        if fam == "mixtral":  # expert groups and vocabulary groups together, either order
            both = make_adapter(cfg, expert_groups=2, vocab_groups=3)
            assert [b.name for b in s.split(2).split_vocab(3).blocks] == [b.name for b in both.blocks]
            assert [b.name for b in s.split_vocab(3).split(2).blocks] == [b.name for b in both.blocks]


def test_a_tied_embedding_is_not_split():
    from tests.integration.tiny_models import tiny

    for fam in ("llama_tied", "gpt2"):
        with pytest.raises(ConfigError):
            describe_model(tiny(fam)[0]).split_vocab(2)


LLAMA_550M = dict(
    model_type="llama", hidden_size=1536, num_hidden_layers=16, vocab_size=49152, intermediate_size=4096,
    num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False,
)  # fmt: skip
"""The issue's 550 M-parameter Llama with a 49 k vocabulary, untied."""


def test_the_planner_plans_a_split_embedding():
    s = describe_model(LLAMA_550M, "llama-550m").split_vocab(3)
    r = search(s, profile(), Budgets(cpu_memory=2 * GiB, gpu_memory=8 * GiB), Request(512, 4096, clip=True))
    assert r.plan.vocab_groups == 3
    assert r.plan.activation_policy[:3] == ("keep",) * 3 and len(r.plan.activation_policy) == len(s.blocks)


def test_the_embedding_and_head_no_longer_set_the_host_floor():
    """Split by vocabulary rows, the embedding's and the head's blocks are each no larger than a decoder
    layer, so the 550 M model's smallest buffer set is sized by its layers: it fits 768 MiB (fp32
    state ÷ 8.6), which unsplit needs 6 × 144 MiB of the head's buffers + state ≈ 888 MiB."""
    s = describe_model(LLAMA_550M)
    layer = max(b.numel for b in s.blocks if b.kind == "layer")
    plan = Plan(schedule="overlap_next_forward")
    whole = sizing.fit_host(s.footprint(2, FORMATS["fp32"]), plan, 768 * MiB)
    assert sizing.host_need(s.footprint(2, FORMATS["fp32"]), whole) > 768 * MiB
    split = s.split_vocab(3)
    assert max(b.numel for b in split.blocks if b.kind in ("embed", "head")) <= layer + s.hidden
    fp = split.footprint(2, FORMATS["fp32"])
    small = sizing.fit_host(fp, dataclasses.replace(plan, vocab_groups=3), 768 * MiB)
    assert sizing.host_need(fp, small) <= 768 * MiB


def test_the_step_graph_reads_the_head_groups_twice_and_runs_their_forward_twice():
    """The split head's cost (``fuyou.engine.turnaround``): every head group but the last is read again
    for the loss's backward pass, and each group's logits are computed twice; nothing else changes."""
    from fuyou.planner.cost import predict
    from fuyou.planner.graph import StepConfig

    s = describe_model(LLAMA_550M)
    split = s.split_vocab(3)
    cfg = StepConfig(micro_batch_size=2, seq_len=512, compute_bytes=2)
    plan = Plan(schedule="overlap_backward")
    whole = predict(s, plan, cfg, profile())
    parts = predict(split, dataclasses.replace(plan, vocab_groups=3), cfg, profile())
    head = 2 * next(b.numel for b in s.blocks if b.kind == "head")
    again = sum(2 * b.numel for b in split.blocks if b.kind == "head") - 2 * split.blocks[-1].numel
    # the default plan recomputes the later embedding groups (only block 0 keeps its graph), whose backward
    # then reads their weights; the whole embedding's backward reads none (``rules.reads_weights_in_backward``)
    recomputed = sum(2 * b.numel for b in split.blocks[1:] if b.kind == "embed")
    assert parts.ssd_read_bytes - whole.ssd_read_bytes == pytest.approx(again + recomputed, rel=0.01)
    assert again == pytest.approx(head * 2 / 3, rel=0.01)
    assert parts.busy_s["compute"] > whole.busy_s["compute"]
