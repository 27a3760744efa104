import pytest
import torch
from transformers import get_scheduler

from fuyou.errors import ConfigError
from fuyou.flops import matmul_params, train_flops_per_token
from fuyou.lr import lr_at
from fuyou.models.adapters import make_adapter
from tests.integration.tiny_models import tiny


@pytest.mark.parametrize("schedule,hf", [("linear", "linear"), ("cosine", "cosine"), ("constant", "constant_with_warmup")])
@pytest.mark.parametrize("warmup", [0, 3])
def test_schedules_match_transformers(schedule, hf, warmup):
    total, base = 20, 1e-3
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = get_scheduler(hf, opt, num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total):
        assert lr_at(step, base, schedule, warmup, total) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
        opt.step()
        sched.step()


def test_bad_schedule():
    with pytest.raises(ConfigError, match="--lr-schedule"):
        lr_at(0, 1.0, "step", 0, 10)
    with pytest.raises(ConfigError, match="--warmup-steps"):
        lr_at(0, 1.0, "linear", -1, 10)


@pytest.mark.parametrize("family", ["llama", "llama_tied", "gpt2"])
def test_matmul_params_counts_linears_and_lm_head(family):
    cfg, model = tiny(family)
    blocks = make_adapter(cfg).blocks
    expected = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2
                   and not any(s in n for s in ("embed_tokens", "wte", "wpe")))
    if "lm_head.weight" not in dict(model.named_parameters()):  # tied: the head multiplies by the embedding
        expected += model.get_input_embeddings().weight.numel()
    assert matmul_params(blocks) == expected
    assert train_flops_per_token(blocks, 2, 64, 16) == 6 * expected + 12 * 2 * 64 * 16
