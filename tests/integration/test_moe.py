"""Mixture-of-experts checkpoints as transformers writes them (one tensor per expert on disk, Mixtral's
``block_sparse_moe`` module name) stream into Fuyou's fused expert tensors, train as the HF model
trains (fp32, with the default global balance loss), and export a directory transformers loads back
to the same weights."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from fuyou.engine import Engine, EngineConfig, Plan
from tests.integration.test_engine_fidelity import LR, STEPS, WD, assert_same
from tests.integration.tiny_models import batches, reference_steps, tiny


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_checkpoint_trains_as_transformers_and_exports_what_it_loads(tmp_path, family):
    cfg, model = tiny(family)
    src = tmp_path / "src"
    model.save_pretrained(src)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # per-expert tensors on disk, not the fused ones
    (tmp_path / "ssd").mkdir()
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path / "ssd"),), precision="fp32", lr=LR, weight_decay=WD, cpu_memory="256MiB",
        plan=Plan(grad_accum=2),
    )  # fmt: skip
    data = batches(STEPS)
    with Engine.from_pretrained(str(src), ec) as eng:
        losses = [eng.train_step(ids, labels).loss for ids, labels in data]
        weights = dict(eng.master_weights())
        eng.export(str(tmp_path / "out"), dtype="fp32")
    ill: dict = {}
    assert_same(model, reference_steps(model, data, 2, LR, WD, balance="global", ill=ill), losses, weights, ill=ill)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(loaded[k], w) for k, w in weights.items())
