"""Multimodal checkpoints (Llama 4, Gemma 3, Mistral 3, Qwen3.5): Fuyou trains the language model, keeps the rest.

The same language model trains bit for bit as it does from a text-only checkpoint (whose training the
fidelity tests hold to plain PyTorch); the vision tower and projector come out of export, resume and
``fuyou export`` exactly as they went in, and transformers loads the exported multimodal model."""

import operator
import os

import pytest
import torch
import transformers

from fuyou.engine import Engine, EngineConfig
from fuyou.engine.export import export_store
from fuyou.errors import ConfigError
from fuyou.models.hf_io import CheckpointReader, load_config
from tests.integration.tiny_models import VOCAB, batches, causal_lm, tiny

VISION = {  # family: (multimodal config and model classes, a tiny vision config, other settings)
    "llama4": (
        "Llama4Config",
        "Llama4ForConditionalGeneration",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
            vision_output_dim=64,
            projector_input_dim=64,
            projector_output_dim=64,
        ),
        {},
    ),
    "gemma3": (  # tied embeddings; stored under language_model.model.* as published
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        {"mm_tokens_per_image": 4},
    ),
    "mistral3": (  # a Mistral text model (sliding window) beside a Pixtral vision tower; stored as Llama 4's
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=16,
            image_size=28,
            patch_size=14,
        ),
        {"spatial_merge_size": 1},
    ),  # fmt: skip
    "kimi_k25": (  # Kimi K2.5/K2.6: DeepSeek-V3's text model beside MoonViT, untied as published
        "Kimi_K25Config",
        "Kimi_K25ForConditionalGeneration",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            pos_emb_height=4,
            pos_emb_width=4,
        ),
        {"projection_hidden_size": 32, "tie_word_embeddings": False},
    ),
    "gemma4": (  # Gemma 4's text model (no per-layer embeddings) beside its vision tower, no audio tower
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            global_head_dim=16,
            position_embedding_size=64,
        ),
        {"audio_config": None},
    ),
    "qwen3_5_moe": (  # linear-attention layers and experts; stored under model.language_model.* and lm_head.*
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
        dict(hidden_size=32, intermediate_size=64, depth=1, num_heads=2, out_hidden_size=64),
        {},
    ),
}

VISION["mistral3_small4"] = VISION["mistral3"]  # Mistral Small 4 as published: Mistral 4's text model (latent
# attention, experts) beside a Pixtral vision tower, in Mistral 3's multimodal model

TEXT = {"mistral3": "mistral_sw", "mistral3_small4": "mistral4", "kimi_k25": "deepseek_v3"}
"""The tiny text model of a multimodal family where its name is not the text family's."""


def mm_model(family: str) -> torch.nn.Module:
    """A multimodal model of ``family``'s tiny text model, random weights (seed 0), in eval mode."""
    text_cfg, _ = tiny(TEXT.get(family, family))
    config_cls, model_cls, vision, extra = VISION[family]
    cfg = getattr(transformers, config_cls)(text_config=text_cfg.to_dict(), vision_config=vision, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg).eval()


def as_published(path, old: str, new: str) -> None:
    """Rename ``old`` to ``new`` in every stored tensor name of the sharded checkpoint at ``path``."""
    import json

    from safetensors.torch import load_file, save_file

    index = path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = {k.replace(old, new): f for k, f in doc["weight_map"].items()}
    index.write_text(json.dumps(doc))
    for shard in set(doc["weight_map"].values()):
        tensors = load_file(str(path / shard))
        save_file({k.replace(old, new): v for k, v in tensors.items()}, str(path / shard), metadata={"format": "pt"})


def multimodal(family: str, path) -> tuple[str, str, dict]:
    """(a multimodal checkpoint of ``family``'s tiny text model, that text model alone as a checkpoint,
    the multimodal model's tensors by stored name), both saved sharded into ``path``."""
    model = mm_model(family)
    model.save_pretrained(path / "mm", max_shard_size="50KB")
    if family == "kimi_k25":  # transformers 5.24 saves its text layers as "blocks" (its vision tower's rename
        as_published(path / "mm", ".model.blocks.", ".model.layers.")  # reverted on every key); published: layers
    text = causal_lm(load_config(str(path / "mm")))
    decoder = next(n for n, m in model.named_modules() if type(m) is type(text.model))
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    own = model.state_dict()
    text.load_state_dict(
        {
            k: own[(decoder + k[len("model") :]) if k.startswith("model.") else head + k[len("lm_head") :]]
            for k in text.state_dict()
        }
    )
    text.save_pretrained(path / "text", max_shard_size="50KB")
    reader = CheckpointReader(str(path / "mm"))
    stored = {k: reader.read_stored(k) for k in reader.where}
    return str(path / "mm"), str(path / "text"), stored


def cfg_for(path, name: str, **kw) -> EngineConfig:
    d = path / name
    d.mkdir(exist_ok=True)
    return EngineConfig(ssd_dirs=(str(d),), cpu_memory="64MiB", precision="fp32", lr=1e-3, max_grad_norm=1.0, **kw)


def train(eng: Engine, data) -> dict:
    for ids, labels in data:
        eng.train_step(ids, labels)
    return dict(eng.master_weights())


@pytest.mark.parametrize(
    "family",
    [
        "llama4",
        "gemma3",
        pytest.param("mistral3", marks=pytest.mark.slow),
        pytest.param("mistral3_small4", marks=pytest.mark.slow),
        pytest.param("kimi_k25", marks=pytest.mark.slow),
        pytest.param("gemma4", marks=pytest.mark.slow),
        pytest.param("qwen3_5_moe", marks=pytest.mark.slow),
    ],
)  # Qwen3.5's linear attention runs transformers' slow reference kernels here
def test_the_text_model_trains_as_alone_and_the_rest_comes_back_unchanged(tmp_path, family):
    mm, text, stored = multimodal(family, tmp_path)
    data = [(ids % VOCAB, labels) for ids, labels in batches(2)]
    with Engine.from_pretrained(text, cfg_for(tmp_path, "a")) as eng:
        alone = train(eng, data)
    with Engine.from_pretrained(mm, cfg_for(tmp_path, "b")) as eng:
        trained = train(eng, data[:1])
    with Engine.resume(cfg_for(tmp_path, "b")) as eng:  # resumed: the store keeps what it does not train
        trained = train(eng, data[1:])
        eng.export(str(tmp_path / "out"), dtype="fp32")
    assert trained.keys() == alone.keys()
    for k, v in alone.items():
        assert torch.equal(trained[k], v), k
    export_store([str(tmp_path / "b")], str(tmp_path / "cli"), dtype="fp32")  # what `fuyou export` does
    config_cls, model_cls, _, _ = VISION[family]
    for out in ("out", "cli"):
        back = CheckpointReader(str(tmp_path / out))
        part = CheckpointReader(mm).part
        assert back.part == part and set(back.untrained()) == {k for k in stored if not part.owns(k)}
        for k in back.untrained():
            assert torch.equal(back.read_stored(k), stored[k]), k  # vision tower, projector: bit for bit
        for k, v in trained.items():
            assert torch.equal(back.get(k), v), k
        loaded = getattr(transformers, model_cls).from_pretrained(tmp_path / out)
        assert isinstance(loaded.config, getattr(transformers, config_cls))
        vision = (c.vision_config.to_dict() for c in (loaded.config, load_config(mm, whole=True)))
        assert operator.eq(*({k: v for k, v in d.items() if k != "dtype"} for d in vision))
        # transformers 5.24's Llama4ForConditionalGeneration.forward fails on text alone (the original model too)
        run = loaded.language_model if family == "llama4" else loaded
        logits = run(input_ids=torch.tensor([[1, 2, 3]])).logits
        assert logits.shape == (1, 3, loaded.config.text_config.vocab_size) and torch.isfinite(logits).all()


def test_a_multimodal_model_whose_text_model_is_no_causal_lm_is_refused(tmp_path):
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
        vision_config=dict(hidden_size=32, depth=1, num_heads=2, out_hidden_size=32),
    )
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="vision-language model whose text model .* is no causal LM"):
        load_config(str(tmp_path))


def test_a_multimodal_checkpoint_without_its_language_model_is_refused(tmp_path):
    mm, _, stored = multimodal("gemma3", tmp_path)
    from safetensors.torch import save_file

    bare = tmp_path / "bare"
    bare.mkdir()
    save_file({k: v for k, v in stored.items() if "language_model" not in k}, str(bare / "model.safetensors"))
    for name in ("config.json",):
        os.link(os.path.join(mm, name), bare / name)
    with pytest.raises(Exception, match="multimodal checkpoint without its language model's embedding"):
        Engine.from_pretrained(str(bare), cfg_for(tmp_path, "c"))


@pytest.mark.parametrize("family", ["gemma3", pytest.param("mistral3_small4", marks=pytest.mark.slow)])
def test_fuyou_finetune_then_export_a_multimodal_checkpoint_with_the_defaults(tmp_path, family):
    """The CLI as users run it (planner, clipping, precision auto): a Gemma 3 checkpoint with a tokenizer;
    Mistral Small 4's layout (Mistral 4's latent attention and experts in Mistral 3's multimodal model)."""
    import shutil

    from click.testing import CliRunner
    from transformers import AutoTokenizer

    from fuyou.cli.main import main
    from tests.integration.tiny_models import cli_inputs

    tok_dir, data = cli_inputs(tmp_path)
    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    text_cfg, _ = tiny(TEXT.get(family, family))
    config_cls, model_cls, vision, extra = VISION[family]
    cfg = getattr(transformers, config_cls)(
        text_config={**text_cfg.to_dict(), "vocab_size": vocab}, vision_config=vision, **extra
    )
    torch.manual_seed(0)
    getattr(transformers, model_cls)(cfg).save_pretrained(tmp_path / "mm")
    for name in os.listdir(tok_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(os.path.join(tok_dir, name), tmp_path / "mm")
    stored = CheckpointReader(str(tmp_path / "mm"))
    before = {k: stored.read_stored(k) for k in stored.untrained()}
    run = tmp_path / "run"
    r = CliRunner().invoke(
        main,
        [
            "finetune",
            str(tmp_path / "mm"),
            "--data",
            data,
            "--output",
            str(run),
            "--steps",
            "2",
            "--seq-len",
            "32",
            "--no-progress",
        ],
    )
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["export", str(run), str(tmp_path / "exported")])
    assert r.exit_code == 0, r.output
    after = CheckpointReader(str(tmp_path / "exported"))
    assert all(torch.equal(after.read_stored(k), v) for k, v in before.items())
    trained = CheckpointReader(str(run / "model"))  # the run's own export, beside its store
    assert trained.part == after.part and set(trained.untrained()) == set(before)
    loaded = getattr(transformers, model_cls).from_pretrained(tmp_path / "exported")
    assert torch.isfinite(loaded(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("family", ["gemma3", pytest.param("llama4", marks=pytest.mark.slow)])
def test_lora_on_a_multimodal_checkpoint_loads_onto_it_in_peft(tmp_path, family):
    """The adapter names the language model's modules as the multimodal model does (Gemma 3 keeps them
    under model.language_model., stored as language_model.model.), and only those: the vision tower has
    q_proj/v_proj of its own. Loaded in peft and merged, it equals Fuyou's merged export."""
    from peft import PeftModel

    from fuyou.models.lora import LoraSettings

    mm, _, stored = multimodal(family, tmp_path)
    cfg = cfg_for(tmp_path, "s", lora=LoraSettings(rank=4, alpha=8, targets=("q_proj", "v_proj")))
    with Engine.from_pretrained(mm, cfg) as eng:
        train(eng, [(ids % VOCAB, labels) for ids, labels in batches(2)])
        eng.export_adapter(str(tmp_path / "adapter"))
        eng.export(str(tmp_path / "merged"), dtype="fp32")
    model_cls = getattr(transformers, VISION[family][1])
    peft = PeftModel.from_pretrained(model_cls.from_pretrained(mm), tmp_path / "adapter")
    adapted = {
        n
        for n, _ in peft.named_modules()
        if n.endswith(("q_proj", "v_proj")) and hasattr(peft.get_submodule(n), "lora_A")
    }
    assert adapted and all("vision" not in n for n in adapted)
    want = peft.merge_and_unload().state_dict()
    got = model_cls.from_pretrained(tmp_path / "merged").state_dict()
    assert want.keys() == got.keys()
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.parametrize(
    "config_cls, top, text",
    [
        ("Qwen3_5Config", True, False),
        ("Qwen3_5Config", False, True),
        ("Llama4Config", True, False),
        ("Llama4Config", False, True),
    ],
)
def test_the_head_is_tied_as_the_multimodal_model_ties_it(config_cls, top, text):
    """Where the two configs disagree, the one of the module that owns the LM head decides (Qwen3.5: the
    multimodal model's; Llama 4: its causal LM's), as transformers itself ties them."""
    from fuyou.models.multimodal import text_config

    cfg = getattr(transformers, config_cls)(
        tie_word_embeddings=top, text_config={"tie_word_embeddings": text, "num_hidden_layers": 1}
    )
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert text_config(cfg).tie_word_embeddings is tied


def test_fuyou_trainer_trains_a_multimodal_model_objects_language_model_as_plain_trainer(tmp_path):
    """A Gemma 3 multimodal model object with its vision tower and projector frozen: FuyouTrainer trains its
    language model to plain Trainer's losses and weights, leaves the rest as it was, and ``save_model``
    writes the whole model transformers loads back."""
    import copy

    from fuyou.models.multimodal import model_part
    from tests.integration.test_hf_trainer import dataset, losses, plain_and_fuyou

    model = mm_model("gemma3")
    part = model_part(model)
    for n, p in model.named_parameters():
        p.requires_grad_(part.owns(n))
    ref_model = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items() if not part.owns(k)}
    ref, fy = plain_and_fuyou(tmp_path, ref_model, model, dataset())
    assert len(losses(fy)) == 6 and losses(fy) == pytest.approx(losses(ref), rel=1e-5)
    ref_sd, got = ref_model.state_dict(), fy.model.state_dict()
    moved = 0
    for k, v in got.items():
        assert (v - ref_sd[k]).abs().max().item() <= 1e-5 * ref_sd[k].abs().max().item() + 1e-12, k
        moved += part.owns(k) and not torch.equal(v, before.get(k, torch.empty(0)))
    assert moved > 0 and all(torch.equal(got[k], v) for k, v in before.items())  # vision tower, projector: as were
    fy.save_model(str(tmp_path / "saved"))
    back = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(tmp_path / "saved")).state_dict()
    assert back.keys() == got.keys() and all(torch.equal(back[k], v) for k, v in got.items())


def test_fuyou_trainer_refuses_a_multimodal_model_whose_vision_tower_would_train_and_image_batches(tmp_path):
    from fuyou import FuyouTrainer, FuyouTrainingArguments
    from fuyou.integrations.hf_trainer import _micro_batch

    ssd = tmp_path / "ssd"
    ssd.mkdir()
    args = FuyouTrainingArguments(output_dir=str(tmp_path / "o"), ssd_dirs=[str(ssd)], use_cpu=True, report_to=[])
    with pytest.raises(ConfigError, match=r"freeze the vision tower and projector"):
        FuyouTrainer(model=mm_model("gemma3"), args=args)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ConfigError, match="pixel_values"):
        _micro_batch({"input_ids": ids, "pixel_values": torch.zeros(1, 3, 28, 28)})


def test_a_fresh_import_opens_the_checkpoint_once(tmp_path, monkeypatch):
    """The import and the store's model files (the multimodal checkpoint's other parts) share one reader:
    the checkpoint's index is read once."""
    mm, _, _ = multimodal("gemma3", tmp_path)
    opened: list[str] = []
    init = CheckpointReader.__init__

    def counted(self, model_dir, *a, **kw):
        opened.append(model_dir)
        init(self, model_dir, *a, **kw)

    monkeypatch.setattr(CheckpointReader, "__init__", counted)
    with Engine.from_pretrained(mm, cfg_for(tmp_path, "a")):
        pass
    assert opened == [mm]
