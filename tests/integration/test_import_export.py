"""HF directory → store (streamed, sharded) → training → HF directory that transformers loads."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from fuyou.engine import Engine, EngineConfig
from fuyou.errors import ConfigError
from fuyou.models.hf_io import ModelFileError
from tests.integration.tiny_models import batches, tiny


def save(model, path, shard="20KB"):
    model.save_pretrained(path, max_shard_size=shard)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64}, f)
    return str(path)


def cfg_for(tmp_path, **kw):
    d = tmp_path / "ssd"
    d.mkdir(exist_ok=True)
    return EngineConfig(ssd_dirs=(str(d),), cpu_memory="64MiB", **kw)


@pytest.mark.parametrize("family", ["llama_tied", "qwen2", "gpt2", "gemma2", "gemma3"])
def test_sharded_import_train_export_round_trip(tmp_path, family):
    _, model = tiny(family)
    src = save(model, tmp_path / "src")
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json")), "expected a sharded checkpoint"
    with Engine.from_pretrained(src, cfg_for(tmp_path, precision="fp32", lr=1e-3)) as eng:
        imported = dict(eng.master_weights())
        for k, v in model.state_dict().items():
            if k in imported:
                assert torch.equal(imported[k], v), k
        for ids, labels in batches(2):
            eng.train_step(ids, labels)
        trained = dict(eng.master_weights())
        eng.export(str(tmp_path / "out"), dtype="fp32")
    out = tmp_path / "out"
    assert (out / "tokenizer_config.json").exists() and not (tmp_path / "out.partial").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for k, v in loaded.state_dict().items():
        key = (
            k
            if k in trained
            else next(e for e in ("model.embed_tokens.weight", "transformer.wte.weight") if e in trained)
        )
        assert torch.equal(v, trained[key]), k
    gen = loaded.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 7)


def test_bf16_export_loads(tmp_path):
    _, model = tiny("llama")
    src = save(model, tmp_path / "src", shard="1GB")
    with Engine.from_pretrained(src, cfg_for(tmp_path, precision="bf16")) as eng:
        eng.export(str(tmp_path / "out"), dtype="bf16")
        eng.export(str(tmp_path / "own"))  # by default in the checkpoint's own dtype (fp32 here)
        with pytest.raises(ConfigError, match="--dtype"):
            eng.export(str(tmp_path / "x"), dtype="int8")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.state_dict()["lm_head.weight"], model.state_dict()["lm_head.weight"].bfloat16())
    own = AutoModelForCausalLM.from_pretrained(tmp_path / "own").state_dict()
    assert all(torch.equal(own[k], v) for k, v in model.state_dict().items())  # untrained: the fp32 masters


def test_bad_model_directories(tmp_path):
    with pytest.raises(ModelFileError, match="no config.json"):
        Engine.from_pretrained(str(tmp_path), cfg_for(tmp_path))
    _, model = tiny("llama")
    src = save(model, tmp_path / "m", shard="1GB")
    os.unlink(os.path.join(src, "model.safetensors"))
    with pytest.raises(ModelFileError, match="no model.safetensors"):
        Engine.from_pretrained(src, cfg_for(tmp_path))
    with open(os.path.join(src, "model.safetensors"), "wb") as f:
        f.write(b"garbage, not safetensors")
    with pytest.raises(ModelFileError, match="missing or corrupt"):
        Engine.from_pretrained(src, cfg_for(tmp_path))


def test_a_checkpoint_its_config_does_not_describe_is_refused_and_leaves_no_store(tmp_path):
    """A tensor whose shape is not the one config.json gives it (another model's config beside the weights)
    is refused in one line naming the tensor and both shapes, midway through the import; the store begun
    is removed, so the SSD directory is as it was and a run with the right config starts afresh."""
    _, model = tiny("llama", layers=2)
    src = save(model, tmp_path / "m", shard="1GB")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    json.dump(config | {"intermediate_size": 96}, open(os.path.join(src, "config.json"), "w"))
    ec = cfg_for(tmp_path)
    with pytest.raises(
        ModelFileError,
        match=r"model.layers.0.mlp.gate_proj.weight has shape \[128, 64\] but this config.json gives it \[96, 64\]",
    ):
        Engine.from_pretrained(src, ec)
    assert os.listdir(ec.ssd_dirs[0]) == []
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    with Engine.from_pretrained(src, ec) as eng:
        assert eng.train_step(*batches(1)[0]).applied


def test_a_state_dict_its_config_does_not_describe_is_refused_by_name(tmp_path):
    """From a state dict (the Trainer plugin's path) the same refusal names the state dict and the model's
    config, not a config.json there is none of; the store begun is removed."""
    cfg, model = tiny("llama", layers=2)
    cfg.intermediate_size = 96
    ec = cfg_for(tmp_path)
    with pytest.raises(
        ModelFileError,
        match=r"^the state dict: model.layers.0.mlp.gate_proj.weight has shape \[128, 64\] but the model's config "
        r"gives it \[96, 64\]",
    ):
        Engine.from_state_dict(cfg, model.state_dict(), ec)
    assert os.listdir(ec.ssd_dirs[0]) == []


def test_unsupported_architecture_lists_supported(tmp_path):
    from transformers import BertConfig

    with pytest.raises(ConfigError, match="unsupported architecture.*LlamaForCausalLM.*GPT2LMHeadModel"):
        Engine.from_state_dict(BertConfig(), {}, cfg_for(tmp_path))


def test_an_attention_kind_fuyou_does_not_run_is_refused_by_name(tmp_path):
    from fuyou.models.adapters import architecture_of
    from tests.integration.tiny_models import tiny

    cfg, _ = tiny("qwen2_sw", layers=2)
    cfg.layer_types = ["full_attention", "mamba"]  # a state-space layer: Jamba's, Falcon-H1's
    with pytest.raises(ConfigError, match=r"unsupported attention layer type\(s\) \['mamba'\]"):
        architecture_of(cfg)
