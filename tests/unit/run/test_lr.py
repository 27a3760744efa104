import pytest
import torch
from transformers import get_scheduler

from fuyou.errors import ConfigError
from fuyou.models.adapters import make_adapter
from fuyou.models.description import describe_model
from fuyou.run.lr import lr_at
from tests.integration.tiny_models import tiny


@pytest.mark.parametrize(
    "schedule,hf", [("linear", "linear"), ("cosine", "cosine"), ("constant", "constant_with_warmup")]
)
@pytest.mark.parametrize("warmup", [0, 3])
def test_schedules_match_transformers(schedule, hf, warmup):
    total, base = 20, 1e-3
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = get_scheduler(hf, opt, num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total):
        assert lr_at(step, base, schedule, warmup, total) == pytest.approx(
            opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15
        )
        opt.step()
        sched.step()


def test_bad_schedule():
    with pytest.raises(ConfigError, match="--lr-schedule"):
        lr_at(0, 1.0, "step", 0, 10)
    with pytest.raises(ConfigError, match="--warmup-steps"):
        lr_at(0, 1.0, "linear", -1, 10)


def _extra_configs():
    """Shapes the tiny families do not cover: multi-query attention with biases, Qwen3's head_dim ≠ hidden/heads."""
    from transformers import LlamaConfig, Qwen3Config

    llama = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=96,
        num_hidden_layers=3,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    )
    llama.architectures = ["LlamaForCausalLM"]
    qwen3 = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=96,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )
    qwen3.architectures = ["Qwen3ForCausalLM"]
    return {"llama_mqa_bias_tied": llama, "qwen3_head_dim": qwen3}


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2", "gpt2", "llama_mqa_bias_tied", "qwen3_head_dim"])
def test_train_flops_count_linears_and_lm_head(family):
    """The one FLOP formula (``ModelShape.train_flops_per_token``, what the run's TFLOPS and the planner's
    prediction use) against the real model: 6 × every matmul weight (tied head included, embeddings not)
    + 12·L·(heads·head_dim)·T, for tied and untied heads, GQA/MQA, biases and a head_dim that is not
    hidden ÷ heads (whose attention is heads · head_dim wide, not hidden)."""
    from transformers import AutoModelForCausalLM

    if family in _extra_configs():
        cfg = _extra_configs()[family]
        model = AutoModelForCausalLM.from_config(cfg)
    else:
        cfg, model = tiny(family)
    expected = sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.dim() == 2 and not any(s in n for s in ("embed_tokens", "wte", "wpe"))
    )
    if "lm_head.weight" not in dict(model.named_parameters()):  # tied: the head multiplies by the embedding
        expected += model.get_input_embeddings().weight.numel()
    # attention: QKᵀ and AV over heads × head_dim (the query projection's width; GPT-2's hidden)
    width = {n: p.shape[0] for n, p in model.named_parameters() if n.endswith("q_proj.weight")}
    width = next(iter(width.values()), cfg.hidden_size)
    shape = describe_model(cfg)
    for seq in (16, 512):
        assert shape.train_flops_per_token(seq) == 6 * expected + 12 * cfg.num_hidden_layers * width * seq
    # the engine's own block FLOPs (what it runs) agree with the planner's blocks
    assert [b.matmul_flops_per_token for b in shape.blocks] == [b.flops_per_token for b in make_adapter(cfg).blocks]
