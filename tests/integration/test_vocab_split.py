"""An embedding and an LM head split by vocabulary rows (``Plan.vocab_groups``, ``fuyou.schedule.vocab``):
the first embedding group (block ``embed``) looks up its rows' tokens and makes the micro-batch context,
each later group (``embed.vocab.<g>``) adds its rows' embeddings; the head's groups (``head`` with the
final norm, ``head.vocab.<g>``) make the loss in two passes (``fuyou.engine.vocab_loss``). It trains what the unsplit model trains (fp32, against
plain PyTorch + AdamW, clipping and accumulation on), exports the whole matrix, resumes bit-identically,
and a tied embedding is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.engine.export import export_store
from fuyou.errors import ConfigError
from fuyou.models.adapters import make_adapter
from tests.integration.test_engine_fidelity import LR, STEPS, WD, assert_same
from tests.integration.test_moe_split import train
from tests.integration.tiny_models import VOCAB, batches, reference_steps, tiny

CLIP = 0.5
TOL = 3e-5
"""The split head's log-sum-exp rounds differently from ``cross_entropy``'s (gradients agree to 1e-6:
``tests/unit/engine/test_vocab_loss.py``); Adam, dividing by √v, carries that into the weights at ~1e-5."""


def config(tmp_path, cfg, groups: int, policy: str = "recompute", **kw) -> EngineConfig:
    tmp_path.mkdir(exist_ok=True)
    n = cfg.num_hidden_layers + 2  # policies for the unsplit blocks: the groups take the embedding's
    plan = Plan(grad_accum=2, vocab_groups=groups, activation_policy=("keep",) + (policy,) * (n - 2) + ("keep",))
    return EngineConfig(
        ssd_dirs=(str(tmp_path),), precision="fp32", lr=LR, weight_decay=WD, cpu_memory="256MiB",
        max_grad_norm=CLIP, plan=plan, **kw,
    )  # fmt: skip


def gemma_untied():
    """A tiny Gemma (scaled embeddings) with its own LM head, so its embedding may be split."""
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, max_position_embeddings=64, num_hidden_layers=2, head_dim=16,
                  query_pre_attn_scalar=16, tie_word_embeddings=False)  # fmt: skip
    cfg = AutoConfig.for_model("gemma", **common)
    cfg.architectures = ["GemmaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    return cfg, model


def padded():
    """A tiny Llama whose embedding has a padding row (60: in the second of two groups)."""
    from transformers import LlamaForCausalLM

    cfg, _ = tiny("llama")
    cfg.pad_token_id = 60
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.train()
    assert model.model.embed_tokens.padding_idx == 60
    return cfg, model


@pytest.mark.parametrize(
    "family, groups, policy",
    [
        ("llama", 2, "keep"),
        ("qwen2", 3, "recompute"),  # uneven rows (32, 32, 32 of 96) under recompute
        ("llama_pad", 2, "swap_cpu"),  # a padding row (its gradient zero) in the second group
        ("gemma", 3, "recompute_cpu"),  # scaled embeddings (√hidden), untied
    ],
)
def test_split_embedding_trains_as_plain_pytorch(tmp_path, family, groups, policy):
    cfg, model = gemma_untied() if family == "gemma" else padded() if family == "llama_pad" else tiny(family)
    data = batches(STEPS)
    losses, weights, eng = train(cfg, model, config(tmp_path, cfg, groups, policy), data)
    names = [b.name for b in eng.layout.blocks]
    layers = [f"layer.{i}" for i in range(cfg.num_hidden_layers)]
    parts = [f"vocab.{g}" for g in range(1, groups)]
    assert names == ["embed", *(f"embed.{p}" for p in parts), *layers, "head", *(f"head.{p}" for p in parts)]
    assert all("[" not in k for k in weights)  # the groups' rows come back as the whole matrix
    ill: dict = {}
    ref = reference_steps(model, data, 2, LR, WD, clip=CLIP, ill=ill)
    assert_same(model, ref, losses, weights, tol=TOL, ill=ill)


def test_a_lost_group_is_caught(tmp_path, monkeypatch):
    """Each later group's rows matter: a group that adds nothing trains wrong, and the test sees it."""
    from fuyou.models import adapters

    cfg, model = tiny("llama")
    data = batches(2)
    real = adapters.VocabRows.forward

    def lost(self, ids):
        out = real(self, ids)
        return out * 0 if self.lo > 0 else out

    monkeypatch.setattr(adapters.VocabRows, "forward", lost)
    losses, weights, _ = train(cfg, model, config(tmp_path, cfg, 2), data)
    with pytest.raises(AssertionError):
        assert_same(model, reference_steps(model, data, 2, LR, WD, clip=CLIP), losses, weights, tol=TOL)


def test_a_lost_head_group_is_caught(tmp_path, monkeypatch):
    """Each head group's backward matters: one that feeds no gradient trains wrong, and the test sees it."""
    from fuyou.engine import vocab_loss

    cfg, model = tiny("llama")
    data = batches(2)
    real = vocab_loss.SplitLoss.backward_group

    def lost(self, logits, lo, hi, dhn):
        if lo > 0:
            return None
        return real(self, logits, lo, hi, dhn)

    monkeypatch.setattr(vocab_loss.SplitLoss, "backward_group", lost)
    losses, weights, _ = train(cfg, model, config(tmp_path, cfg, 2), data)
    with pytest.raises(AssertionError):
        assert_same(model, reference_steps(model, data, 2, LR, WD, clip=CLIP), losses, weights, tol=TOL)


def test_export_and_resume(tmp_path):
    """The store records its vocabulary groups, so a resumed run and ``export`` see the same layout;
    the export holds the whole embedding transformers loads, and a run resumed midway ends
    bit-identical to an uninterrupted one."""
    cfg, model = tiny("llama")
    src = tmp_path / "src"
    model.save_pretrained(src)
    data = batches(4)
    with Engine.from_pretrained(str(src), config(tmp_path / "a", cfg, 3)) as eng:
        for ids, labels in data:
            eng.train_step(ids, labels)
        whole = dict(eng.master_weights())
        eng.export(str(tmp_path / "out"), dtype="fp32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert loaded["model.embed_tokens.weight"].shape == loaded["lm_head.weight"].shape == (VOCAB, cfg.hidden_size)
    assert all(torch.equal(loaded[k], w) for k, w in whole.items())
    export_store([str(tmp_path / "a")], str(tmp_path / "cli"), "fp32")  # ``fuyou export``: the store's own layout
    from_store = AutoModelForCausalLM.from_pretrained(tmp_path / "cli").state_dict()
    assert all(torch.equal(from_store[k], w) for k, w in whole.items())

    ec = config(tmp_path / "b", cfg, 3)
    with Engine.from_pretrained(str(src), ec) as eng:
        for ids, labels in data[:2]:
            eng.train_step(ids, labels)
    fresh = EngineConfig(**{**ec.__dict__, "plan": Plan(grad_accum=2)})  # the groups come from the store
    with Engine.resume(fresh) as eng:
        assert eng.plan.vocab_groups == 3 and eng.step == 2
        for ids, labels in data[2:]:
            eng.train_step(ids, labels)
        resumed = dict(eng.master_weights())
    assert all(torch.equal(resumed[k], w) for k, w in whole.items())


def test_split_lowers_the_host_weight_buffers():
    """The host weight buffers are sized by the largest block: split, the embedding no longer is it."""
    cfg, _ = tiny("llama", hidden=64)
    whole = make_adapter(cfg).blocks
    split = make_adapter(cfg, vocab_groups=3).blocks
    assert [b.numel for b in split[:3]] == [whole[0].numel // 3] * 3
    head = whole[-1].numel - cfg.hidden_size  # the LM head's rows; the final norm goes with the first group
    assert [b.numel for b in split[-3:]] == [head // 3 + cfg.hidden_size, head // 3, head // 3]
    assert sum(b.numel for b in split) == sum(b.numel for b in whole)


def test_a_tied_embedding_is_refused():
    cfg, _ = tiny("llama_tied")
    with pytest.raises(ConfigError, match="tied"):
        make_adapter(cfg, vocab_groups=2)
    cfg, _ = tiny("gpt2")
    with pytest.raises(ConfigError, match="vocabulary groups"):
        make_adapter(cfg, vocab_groups=2)


def test_the_engine_splits_when_the_host_budget_needs_it(tmp_path):
    """``vocab_groups`` left to the engine (0, the default): a 16 k × 128 embedding and head (8 decoder
    layers' worth each) under a 48 MiB host budget, which the unsplit buffers (6 × 8 MiB of the head
    + state chunks) do not fit, are split into the 9 groups that bring each within a layer, and train
    as plain PyTorch does; with room (96 MiB) they stay whole."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=16384, max_position_embeddings=64, num_hidden_layers=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.train()
    data = batches(STEPS)
    for d in "ab":
        (tmp_path / d).mkdir()
    tight = EngineConfig(ssd_dirs=(str(tmp_path / "a"),), precision="fp32", lr=LR, weight_decay=WD,
                         cpu_memory="48MiB", max_grad_norm=CLIP, plan=Plan(grad_accum=2))  # fmt: skip
    losses, weights, eng = train(cfg, model, tight, data)
    assert eng.plan.vocab_groups == 9 and eng.layout.blocks[-1].name == "head.vocab.8"
    ill: dict = {}
    ref = reference_steps(model, data, 2, LR, WD, clip=CLIP, ill=ill)
    assert_same(model, ref, losses, weights, tol=TOL, ill=ill, max_ill=0.5)  # the embedding's unused rows
    roomy = EngineConfig(**{**tight.__dict__, "cpu_memory": "96MiB", "ssd_dirs": (str(tmp_path / "b"),)})
    with Engine.from_state_dict(cfg, {k: v.detach().clone() for k, v in model.state_dict().items()}, roomy) as eng:
        assert eng.plan.vocab_groups == 1
