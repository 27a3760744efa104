"""Which families run: the tested lists, the standard decoder shape read from the library's source."""

import warnings

import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fuyou.errors import ConfigError, FuyouWarning
from fuyou.models.families import STANDARD, STANDARD_MOE, TESTED, architecture_of, handed_from, standard_shape


def test_every_tested_standard_family_runs_without_a_warning():
    # OLMo 3, EXAONE 4 and StarCoder2 build their masks otherwise than the verified families (their
    # base model's forward differs): proven by the fidelity tests, they are listed, not inferred
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_PRETRAINING_MAPPING_NAMES,
    )

    # Mistral 4's causal LM is in transformers' pretraining mapping only (5.24)
    names = MODEL_FOR_PRETRAINING_MAPPING_NAMES | MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    types = {v: k for k, v in names.items() if v in STANDARD + STANDARD_MOE}
    assert set(types) == set(STANDARD + STANDARD_MOE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for arch, t in types.items():
            assert architecture_of(CONFIG_MAPPING[t]()) == arch
    assert standard_shape("olmo3") is not None and standard_shape("olmo2") is None


@pytest.mark.parametrize(
    "model_type, part",
    [
        ("granite", "GraniteForCausalLM.forward"),
        ("cohere", "CohereForCausalLM.forward"),
        ("jamba", "JambaModel.forward"),
    ],
)
def test_a_family_that_scales_its_logits_or_differs_around_its_layers_is_refused_naming_where(model_type, part):
    # Granite divides its logits by logits_scaling, Cohere multiplies them by logit_scale: streamed through
    # the generic adapter they would train another model without a word
    with pytest.raises(ConfigError, match=f"unsupported architecture .*{part}.*departs"):
        architecture_of(CONFIG_MAPPING[model_type]())


def test_an_untested_family_of_the_standard_shape_runs_and_says_so():
    cfg = CONFIG_MAPPING["seed_oss"]()
    assert "SeedOssForCausalLM" not in TESTED
    with pytest.warns(FuyouWarning, match="SeedOssForCausalLM is untested"):
        assert architecture_of(cfg) == "SeedOssForCausalLM"


@pytest.mark.parametrize(
    "model_type, says", [("t5", "encoder-decoder"), ("bert", "BertLMHeadModel.forward departs"), ("gemma3", "vision")]
)
def test_models_that_are_not_decoder_stacks_are_refused_saying_why(model_type, says):
    with pytest.raises(ConfigError, match=says):
        architecture_of(CONFIG_MAPPING[model_type]())


@pytest.mark.parametrize(
    "fields, says",
    [
        ({}, r"per-layer embeddings \(hidden_size_per_layer_input=256\)"),  # the config's default (Gemma 4 E2B's)
        ({"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 2}, "reuse earlier layers' keys and values"),
        ({"hidden_size_per_layer_input": 0, "use_bidirectional_attention": "all"}, "attends bidirectionally"),
    ],
)
def test_gemma4_variants_fuyou_does_not_stream_are_refused_saying_what(fields, says):
    cfg = CONFIG_MAPPING["gemma4_text"](num_hidden_layers=4, **fields)
    with pytest.raises(ConfigError, match=f"unsupported Gemma4ForCausalLM variant: .*{says}"):
        architecture_of(cfg)


def test_gemma4_without_them_is_a_tested_family():
    cfg = CONFIG_MAPPING["gemma4_text"](num_hidden_layers=4, hidden_size_per_layer_input=0)
    assert architecture_of(cfg) == "Gemma4ForCausalLM" and "Gemma4ForCausalLM" in TESTED


def test_a_causal_lm_transformers_left_out_of_its_causal_lm_mapping_is_found():
    """transformers 5.24 ships ``Mistral4ForCausalLM`` but maps ``mistral4`` to it only for pretraining:
    Fuyou finds it there (before the fallback, a Mistral 4 model was refused as "not a causal language
    model transformers knows")."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from fuyou.models.families import causal_lm_class

    assert "mistral4" not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # else this test proves nothing: drop the fallback
    assert causal_lm_class("mistral4").__name__ == "Mistral4ForCausalLM"
    assert causal_lm_class("t5") is None  # T5ForConditionalGeneration, its pretraining model, is no causal LM


def test_a_shared_indexer_layer_reads_the_last_full_layer_before_it():
    """GLM-5 (``HANDED_ON``): transformers hands each layer the top-k indices the layer before it used, so a
    run of shared layers reads the last full one; a shared first layer is refused before any work."""
    cfg = CONFIG_MAPPING["glm_moe_dsa"](num_hidden_layers=5)
    assert handed_from(cfg) == [None] * 5  # the config's default: every layer runs its own indexer
    cfg.indexer_types = ["full", "shared", "shared", "full", "shared"]
    assert handed_from(cfg) == [None, 0, 0, None, 3]
    assert handed_from(CONFIG_MAPPING["deepseek_v32"](num_hidden_layers=2)) is None
    cfg.indexer_types = ["shared"] + ["full"] * 4
    with pytest.raises(ConfigError, match="layer 0 of this glm_moe_dsa config reuses an earlier layer's top-k"):
        handed_from(cfg)
