"""Which model families Fuyou runs, and how it tells: the tested lists, and the standard decoder shape.

A family runs through the generic decoder-stack adapter (``adapters.LlamaLike``: embedding → decoder
layers → final norm → LM head, each the library's own module, called as the library's ``forward``
calls them) when what the library does *around* the layers is what that adapter does. That is
checked on the library's source, not on a list: a family's ``…ForCausalLM.forward`` and its base
model's ``forward`` must be, statement for statement (their syntax trees, docstrings left out), the
ones of a family whose streamed training is proven equal to plain PyTorch by the tests
(``VERIFIED``). A family that scales its logits or its embeddings, or calls its layers with
other arguments, differs there and is refused, naming the method. The decoder layers themselves are
the family's own modules, whatever they compute inside.

``TESTED`` families are proven by ``tests/integration/test_engine_fidelity.py`` (fp32, ≤ 1e-5 against
PyTorch + AdamW); another family of the standard shape trains with a ``FuyouWarning`` that says it is
untested. Families whose layers need more (linear-attention layers, a router's balancing buffer) are
refused by what does not fit: an attention layer kind, a buffer the adapter cannot rebuild
(``LlamaLike.prepare``), or the forward check. What the check cannot see fails inside the family's own
layer, after the warning (Youtu's multi-head latent attention: a shape error in its first layer).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import warnings
from typing import Any

from fuyou.errors import ConfigError, FuyouWarning

LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")
GEMMA = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM")
"""Gemma 1/2/3/4 (text): Llama-like blocks with scaled embeddings, soft-capped attention and logits
(Gemma 2), per-layer-kind rotary tables (Gemma 3, 4), and Gemma 4's per-kind head sizes, keys reused as
values (``attention_k_eq_v``), per-layer output scalars and a mixture of experts beside the dense MLP.
Gemma 4's per-layer embeddings and shared key-value layers are refused (``gemma4_departures``)."""
MOE = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "Glm4MoeForCausalLM",
    "DeepseekV3ForCausalLM",
    "Llama4ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
)
"""Mixture-of-experts families: a decoder layer (attention, router, every expert, shared experts) is one
block. GPT-OSS: attention sinks (eager attention: ``adapters.attention_kernel``), biased router and
experts, alternating sliding windows. Qwen3-Next: Qwen3.5-MoE's layers (Gated DeltaNet beside gated
attention) without its multi-axis RoPE."""
LINEAR_ATTENTION = ("Qwen3_5ForCausalLM",)
"""Dense families with linear-attention layers (Qwen3.5's Gated DeltaNet, beside gated full attention);
Qwen3.5-MoE is among the ``MOE``."""
GPT2 = ("GPT2LMHeadModel",)
STANDARD = (
    "OlmoForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "GlmForCausalLM",
    "Glm4ForCausalLM",
    "HeliumForCausalLM",
    "ArceeForCausalLM",
    "Ministral3ForCausalLM",
    "Exaone4ForCausalLM",
    "HunYuanDenseV1ForCausalLM",
    "Starcoder2ForCausalLM",
    "Ernie4_5ForCausalLM",
    "SmolLM3ForCausalLM",
)
"""Dense families of the standard decoder shape that the generic adapter runs with no code of their
own (OLMo 1/2/3, GLM and GLM-4, Helium, Arcee, Ministral 3, EXAONE 4, Hunyuan dense, StarCoder2,
ERNIE 4.5, SmolLM3's NoPE layers)."""
STANDARD_MOE = (
    "DeepseekV2ForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "Ernie4_5_MoeForCausalLM",
    "HunYuanMoEV1ForCausalLM",
    "OlmoeForCausalLM",
    "FlexOlmoForCausalLM",
    "SolarOpenForCausalLM",
    "MiniMaxM2ForCausalLM",
    "Mistral4ForCausalLM",
    "Dots1ForCausalLM",
    "DeepseekV32ForCausalLM",
    "ExaoneMoeForCausalLM",
    "HYV3ForCausalLM",
    "Kolibri1ForCausalLM",
    "GlmMoeDsaForCausalLM",
    "LongcatFlashForCausalLM",
    "AfmoeForCausalLM",
)
"""Mixtures of experts of the standard decoder shape that the generic adapter runs with no code of their
own (DeepSeek-V2, GLM-4 MoE Lite, ERNIE 4.5 MoE, Hunyuan MoE, OLMoE, FlexOlmo, Solar Open, MiniMax-M2,
Mistral 4, dots.llm1, DeepSeek-V3.2, K-EXAONE, Hy3, Kolibri1, LongCat-Flash: each layer two attention and MLP
sublayers beside one mixture of experts with zero-computation experts; AFMoE, whose muP input scaling
``embedding_scale`` applies), and GLM-5 (``glm_moe_dsa``), whose layers
hand their sparse attention's top-k keys on to later layers (``HANDED_ON``). Listed because the fidelity tests prove them,
though several base models' ``forward`` differ from the verified ones in form (another mask mapping, no
sliding window); AFMoE's scales its embeddings by a config flag, tested both ways."""
TESTED = LLAMA_LIKE + GEMMA + MOE + LINEAR_ATTENTION + GPT2 + STANDARD + STANDARD_MOE
"""Every family the fidelity tests prove."""
VERIFIED = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
)
"""Families (``model_type``) whose ``forward`` methods define the standard decoder shape: dense, and
mixtures of experts with a balance loss (Mixtral, Qwen2/3-MoE) or a routing bias instead (GLM-4.5,
DeepSeek-V3)."""
UNTRAINED: dict[str, tuple[str, ...]] = {
    "deepseek_v32": ("*.self_attn.indexer.*",),
    "glm_moe_dsa": ("*.self_attn.indexer.*",),
}
"""Per ``model_type``: globs of the parameters its ``transformers`` code computes without gradient
(DeepSeek-V3.2's and GLM-5's lightning indexers, run under ``torch.no_grad``: transformers does not train
them, as their makers train them with a loss of their own). They never train in Fuyou either (``untrained``)."""
HANDED_ON: dict[str, tuple[str, str]] = {"glm_moe_dsa": ("prev_topk_indices", "indexer_types")}
"""Per ``model_type``: a value each decoder layer returns beside its hidden states and later layers take
as an argument — (that argument's name, the config list saying which layers read it instead of making
their own). GLM-5: a layer whose ``indexer_types`` entry is ``shared`` attends to the keys the last
``full`` layer's indexer picked (integer top-k indices, no gradient). ``handed_from`` is the rule."""


def handed_from(config: Any) -> list[int | None] | None:
    """For each decoder layer, the earlier layer whose handed-on value (``HANDED_ON``) it reads, or None
    where it makes its own; None for a family whose layers hand nothing on. A ``shared`` layer reads the
    last ``full`` one before it (what ``transformers`` passes it: each layer returns the indices it used,
    a shared layer those it was given). Raises ConfigError for a shared layer with no full one before it."""
    rule = HANDED_ON.get(getattr(config, "model_type", "") or "")
    if rule is None:
        return None
    kinds = list(getattr(config, rule[1]))
    reads: list[int | None] = []
    last: int | None = None
    for i, kind in enumerate(kinds):
        if kind == "shared" and last is None:
            raise ConfigError(
                f"layer {i} of this {config.model_type} config reuses an earlier layer's top-k keys ({rule[1]}) "
                "but no layer before it makes them; its first layer must be 'full'"
            )
        reads.append(last if kind == "shared" else None)
        last = i if kind != "shared" else last
    return reads


def embedding_scale(config: Any) -> float | None:
    """The factor a family's base model multiplies its embeddings by before the first layer, outside its
    embedding module (AFMoE's muP input scaling: √hidden where ``mup_enabled``); None: none."""
    if getattr(config, "model_type", None) == "afmoe" and getattr(config, "mup_enabled", False):
        return float(config.hidden_size**0.5)
    return None


def untrained(config: Any) -> tuple[str, ...]:
    """Globs of ``config``'s parameters that never train (``UNTRAINED``; none for most families)."""
    return UNTRAINED.get(getattr(config, "model_type", "") or "", ())


ATTENTION_MASKS: dict[str, str | None] = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
    "linear_attention": None,  # a recurrence over the whole row: no mask
    "indexed_attention": "create_causal_mask",  # DeepSeek-V3.2's sparse attention: its indexer needs the mask made
}
"""The per-layer attention kinds (``config.layer_types``) Fuyou runs, each with the ``transformers.masking_utils``
function that makes its mask (None: the kind takes none)."""
MASK_OPTIONS: dict[str, dict[str, Any]] = {"indexed_attention": {"allow_is_causal_skip": False}}
"""Keyword arguments a kind's mask function takes beyond the usual: DeepSeek-V3.2's indexer scores keys under
the mask itself, so its causal mask is always made, never skipped for ``is_causal``."""
ATTENTION_KINDS = tuple(ATTENTION_MASKS)


@functools.cache
def _classes(model_type: str) -> tuple[Any, Any]:
    """(``…ForCausalLM`` class, its base model class) of ``model_type`` in the installed transformers
    (its auto mappings). Raises ConfigError if transformers has no causal LM of that type."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    name, base = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type), MODEL_MAPPING_NAMES.get(model_type)
    name = name or _unmapped_causal_lm(model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    model_cls = getattr(transformers, base, None) if isinstance(base, str) else None  # some map to several
    if cls is None:
        raise ConfigError(
            f"model type {model_type!r} is not a causal language model transformers {transformers.__version__} "
            "knows; Fuyou trains decoder-only causal LMs"
        )
    if model_cls is None:
        raise ConfigError(f"{cls.__name__} has no base model class; Fuyou cannot read its layer stack")
    return cls, model_cls


def _unmapped_causal_lm(model_type: str) -> str | None:
    """The ``…ForCausalLM`` class of ``model_type`` that transformers ships but left out of its causal-LM
    auto mapping (5.24: ``mistral4``, listed for pretraining only), else None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_PRETRAINING_MAPPING_NAMES

    name = MODEL_FOR_PRETRAINING_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) and name.endswith("ForCausalLM") else None


def causal_lm_class(model_type: str) -> Any:
    """transformers' ``…ForCausalLM`` class of ``model_type``, or None if it has none."""
    try:
        return _classes(model_type)[0]
    except ConfigError:
        return None


def base_model_class(model_type: str) -> Any:
    """transformers' base model class of ``model_type`` (the decoder stack a causal LM wraps); raises
    ConfigError as ``_classes``."""
    return _classes(model_type)[1]


def _body(fn: Any) -> str:
    """The syntax tree of ``fn``'s body, docstring left out, as text (equal text: equal statements)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef))
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]), annotate_fields=False)


@functools.cache
def _verified_forwards() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """The causal-LM and base-model ``forward`` bodies of the ``VERIFIED`` families, and their balance
    loss functions' (``load_balancing_loss_func``, where the family has one)."""
    pairs = [_classes(t) for t in VERIFIED]
    losses = (_balance_loss(c) for c, _ in pairs)
    return (
        frozenset(_body(c.forward) for c, _ in pairs),
        frozenset(_body(m.forward) for _, m in pairs),
        frozenset(_body(f) for f in losses if f is not None),
    )


def _balance_loss(cls: Any) -> Any:
    """The balance loss function of ``cls``'s modeling module, or None."""
    import sys

    return getattr(sys.modules[cls.__module__], "load_balancing_loss_func", None)


@functools.cache
def standard_shape(model_type: str) -> str | None:
    """None if ``model_type``'s causal LM wraps its layers as the verified families do (see the module
    docstring); else what departs, as a sentence. Raises ConfigError if transformers has no causal
    LM of that type."""
    cls, model_cls = _classes(model_type)
    causal, base, losses = _verified_forwards()
    if _body(cls.forward) not in causal:
        return f"{cls.__name__}.forward departs from the standard decoder's (e.g. scaled or capped logits)"
    if _body(model_cls.forward) not in base:
        return (
            f"{model_cls.__name__}.forward departs from the standard decoder's (e.g. scaled embeddings, "
            "extra inputs to its layers)"
        )
    loss = _balance_loss(cls)
    if loss is not None and _body(loss) not in losses:
        return "its load_balancing_loss_func departs from the verified mixtures of experts' (Fuyou computes it)"
    return None


def architecture_of(config: Any) -> str:
    """The config's architecture name (``architectures[0]``, else transformers' causal LM of its
    ``model_type``). A tested family is returned as it is; another one of the standard decoder shape
    (``standard_shape``) with a ``FuyouWarning`` that it is untested. Raises ConfigError naming what
    Fuyou does not run: not a causal LM, a departure from the standard shape, an attention layer kind
    (``layer_types``)."""
    model_type = getattr(config, "model_type", "") or ""
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"{model_type or 'this model'} is an encoder-decoder model; Fuyou trains decoder-only causal LMs"
        )
    if getattr(config, "vision_config", None) is not None:
        raise ConfigError(
            f"{model_type or 'this model'} is a vision-language model object; Fuyou trains its text model from "
            "the checkpoint directory (fuyou finetune MODEL_DIR keeps the vision tower unchanged)"
        )
    archs = getattr(config, "architectures", None) or []
    causal = causal_lm_class(model_type) if not archs and model_type else None
    name = archs[0] if archs else (causal.__name__ if causal is not None else "")
    if name not in TESTED:
        if not model_type:
            raise ConfigError(f"architecture {name or '?'!r} names no model_type; pass a complete config.json")
        why = standard_shape(model_type)
        if why is not None:
            raise ConfigError(
                f"unsupported architecture {name or model_type!r} (model type {model_type}): {why}; Fuyou runs "
                "the standard decoder shape "
                f"and the tested families {', '.join(TESTED)}"
            )
        warnings.warn(
            f"{name or model_type} is untested with Fuyou: it has the standard decoder shape (embedding → "
            "layers → norm → head, as Llama), so it runs through the generic adapter; compare a few steps "
            "with plain PyTorch before a long run",
            FuyouWarning,
            stacklevel=2,
        )
    why = gemma4_departures(config)
    if why:
        raise ConfigError(f"unsupported {name} variant: {why}")
    if name not in GPT2:
        layer_types(config)  # an attention kind Fuyou does not run is refused by name, before any work
    return name


def gemma4_departures(config: Any) -> str | None:
    """What of a Gemma 4 text config Fuyou does not stream, as a clause (None: nothing, or not Gemma 4).

    Its per-layer embeddings (``hidden_size_per_layer_input`` > 0: the embedding block feeds every decoder
    layer a slice of a second embedding, and each layer's backward would have to send a gradient back to it)
    and its shared key-value layers (``num_kv_shared_layers`` > 0: later layers attend with an earlier
    layer's keys and values) carry tensors between blocks besides the hidden states, which Fuyou's
    block-by-block step does not; a bidirectional model (``use_bidirectional_attention="all"``) is no
    causal LM."""
    if getattr(config, "model_type", None) != "gemma4_text":
        return None
    if getattr(config, "hidden_size_per_layer_input", 0):
        return (
            f"per-layer embeddings (hidden_size_per_layer_input={config.hidden_size_per_layer_input}) feed every "
            "layer from the embedding, which Fuyou's block-by-block step does not carry; Gemma 4 models without "
            "them (hidden_size_per_layer_input 0 in config.json) train"
        )
    if getattr(config, "num_kv_shared_layers", 0):
        return (
            f"its last {config.num_kv_shared_layers} layers reuse earlier layers' keys and values "
            "(num_kv_shared_layers), which Fuyou's block-by-block step does not carry; Gemma 4 models without "
            "them (num_kv_shared_layers 0) train"
        )
    if getattr(config, "use_bidirectional_attention", None) == "all":
        return "it attends bidirectionally (use_bidirectional_attention='all'); Fuyou trains causal LMs"
    return None


def layer_types(config: Any) -> list[str]:
    """Each decoder layer's attention, as the family's own ``forward`` picks its mask:
    ``config.layer_types`` where the family has them (Qwen2/3: ``sliding_attention`` past
    ``max_window_layers`` with ``use_sliding_window``), else ``sliding_attention`` for every layer when
    the config sets a ``sliding_window`` (Mistral), else ``full_attention``. Raises ConfigError for
    another kind, by name."""
    types = list(getattr(config, "layer_types", None) or [])
    if not types:
        sliding = getattr(config, "sliding_window", None) is not None
        types = ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers
    unknown = sorted(set(types) - set(ATTENTION_KINDS))
    if unknown:
        raise ConfigError(
            f"unsupported attention layer type(s) {unknown} in this {getattr(config, 'model_type', '?')} config; "
            f"Fuyou supports {', '.join(ATTENTION_KINDS)}"
        )
    return types
