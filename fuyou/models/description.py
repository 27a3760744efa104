"""One model description: the planner's ``ModelShape`` derived from the model itself.

The adapter builds the model's skeleton on the meta device (``fuyou.models.adapters``) and cuts it into
the blocks the engine streams; the store layout (``fuyou.models.store_layout``) says how many elements
each block's flat vectors hold and which parameters ``--freeze`` moves to its read-only part. The
planner's shape of each block comes from the same objects: elements and frozen elements from the
layout, matmul FLOPs and LoRA's linear dimensions from the block's parameters and modules, the largest
weight tensor (backward's fresh gradient) from its parameters. What a block holds on the device while
it computes — saved tensors, forward and backward transients — is measured on its own modules at the
run's sequence length and dtype, on fake tensors (``probe``: ``fuyou.models.activation_probe``); the
family's rule (``fuyou.models.activation_rules``) stands in where the modules cannot run on them.

Named shapes (``GPT-3-13B``, ``llama-3-8b``, ``mixtral-8x7b``…) are Hugging Face configs
(``fuyou.schedule.shapes.NAMED``) described the same way. Building a skeleton costs no memory (meta
tensors): about 2 s for Llama-3.1-405B's 126 layers, milliseconds for small models.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import warnings
from typing import Any

from torch import nn

from fuyou.errors import ConfigError
from fuyou.models import activation_rules
from fuyou.models.activation_probe import probe_block
from fuyou.models.adapters import Adapter, make_adapter
from fuyou.models.families import layer_types, untrained
from fuyou.models.freeze import frozen_blocks, frozen_keys
from fuyou.models.multimodal import text_config
from fuyou.models.store_layout import ModelLayout
from fuyou.schedule import rules
from fuyou.schedule.device_memory import BlockMemory
from fuyou.schedule.shapes import NAMED, BlockShape, ModelShape


def describe_model(
    config: Any, name: str = "model", expert_groups: int = 1, vocab_groups: int = 1, freeze: tuple[str, ...] = ()
) -> ModelShape:
    """The ModelShape of a Hugging Face ``config`` (a ``PretrainedConfig`` or its dict), its
    mixture-of-experts layers split into ``expert_groups``, its embedding and head into
    ``vocab_groups`` blocks of vocabulary rows, the parameters ``freeze`` globs match frozen.

    Raises ConfigError for an architecture the adapters do not support, groups that do not split the
    experts or rows, or a ``freeze`` pattern that matches nothing (or everything).
    """
    cfg = _config(config, name)
    key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    return _describe(key, name, expert_groups, vocab_groups, tuple(freeze))


@functools.lru_cache(maxsize=64)
def _describe(key: str, name: str, groups: int, vocab_groups: int, freeze: tuple[str, ...]) -> ModelShape:
    cfg = _config(json.loads(key), name)
    adapter = make_adapter(cfg, expert_groups=groups, vocab_groups=vocab_groups)
    specs = tuple(adapter.blocks)
    never = untrained(cfg)
    layout = ModelLayout(
        specs, frozen_blocks=frozen_blocks(specs, freeze, never), frozen_params=frozen_keys(specs, freeze, never)
    )
    d = cfg.to_dict()
    d |= {alias: getattr(cfg, alias) for alias in getattr(cfg, "attribute_map", {})}  # the family's other names
    moe = bool(activation_rules.experts_of(d))
    blocks = tuple(_block(adapter, layout, d, b, moe) for b in range(len(specs)))
    hidden, layers = adapter.hidden, int(getattr(cfg, "num_hidden_layers", None) or d["n_layer"])  # LongCat: a property
    bufs = [x for blk in specs for x in blk.buffers]
    held = (sum(x.numel for x in bufs if x.fp32), sum(x.numel for x in bufs if not x.fp32))

    def again(expert_groups: int, vocab_groups: int) -> ModelShape:
        return _describe(key, name, expert_groups, vocab_groups, freeze)

    return ModelShape(
        name, blocks, hidden, layers, int(d["vocab_size"]), activation_rules.experts_of(d), groups, vocab_groups,
        held=held, source=d, describer=again, probe=_Prober(adapter),
        lora_dims=functools.partial(_moe_lora_dims, key) if moe else None,
    )  # fmt: skip


class _Prober:
    """Each block's device memory measured on ``adapter``'s own modules (``activation_probe``), once
    per block kind (its parameters' shapes, attention kind, expert group size), compute size and
    micro-batch shape: the layers of a model share one measurement."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.cache: dict[tuple, BlockMemory | None] = {}
        self.lock = threading.Lock()
        types = getattr(adapter.config, "layer_types", None) or []
        self.kinds = [self._kind(adapter, b, types) for b in range(len(adapter.blocks))]

    @staticmethod
    def _kind(a: Adapter, b: int, types: list[str]) -> tuple:
        layer = _layer_of(a, b)
        return (
            _kind(a, b),
            tuple(p.shape for p in a.blocks[b].params),
            types[layer] if 0 <= layer < len(types) else None,
            a.route_of(b) is not None,
            a.additive(b),
            layer in a.sources,  # it hands a value on (GLM-5's top-k keys): held on the device
        )

    def __call__(self, b: int, compute_bytes: int, seq_len: int, micro_batch: int) -> BlockMemory | None:
        key = (self.kinds[b], compute_bytes, seq_len, micro_batch)
        got = self.cache.get(key, self)
        if got is not self:
            return got  # type: ignore[return-value]  # a BlockMemory or None, cached
        with self.lock:
            if key not in self.cache:
                self.cache[key] = probe_block(self.adapter, b, compute_bytes, seq_len, micro_batch)
            return self.cache[key]


def _block(adapter: Adapter, layout: ModelLayout, cfg: dict[str, Any], b: int, moe: bool = False) -> BlockShape:
    """Block ``b`` of ``adapter`` as the planner sees it (``moe``: a mixture of experts, whose LoRA
    parameters the shape counts apart, ``_moe_lora_dims``)."""
    spec = layout.blocks[b]
    kind = _kind(adapter, b)
    frozen = set(layout.frozen_params)
    matrices = [p for p in spec.params if len(p.shape) >= 2]
    mm_frozen = sum(p.numel for p in matrices if p.key in frozen)
    mm_all = sum(p.numel for p in matrices)
    flops = spec.flops_per_token
    largest = max((p.numel for p in spec.params), default=0) if kind in ("layer", "experts") else 0
    if kind == "layer":
        rule = activation_rules.layer(cfg, _layer_of(adapter, b), adapter.expert_groups, _is_moe(adapter, b))
    elif kind == "experts":
        lo, hi = adapter.slices[b]
        rule = activation_rules.expert_group(cfg, hi - lo)
    else:
        rule = activation_rules.NONE
    whole = not layout.trains(b)
    return BlockShape(
        spec.name,
        kind,
        layout.numel(b),
        flops,
        rule.act_bytes_per_token,
        spec.borrows,
        rule.act_bytes_per_token_per_key,
        _linear_dims(adapter, b) if kind == "layer" and not moe else 0,
        keeps_input=not adapter.additive(b),
        frozen=whole,
        frozen_numel=layout.frozen_numel(b) if not whole else 0,
        frozen_matmul_flops_per_token=round(flops * mm_frozen / mm_all) if mm_frozen and not whole else 0,
        work_elems_per_token=rule.work_elems_per_token,
        bwd_fixed_elems=largest,
        attn_flops_per_key=_attention_width(adapter, cfg, b) if kind == "layer" else 0,
        window=_window(adapter, cfg, b) if kind == "layer" else 0,
        act_fp32_bytes_per_token=rule.act_fp32_bytes_per_token,
    )


def _kind(adapter: Adapter, b: int) -> str:
    """``embed`` | ``layer`` | ``experts`` | ``head`` of block ``b`` (``rules.block_kind``)."""
    return rules.block_kind(adapter.blocks[b].name, b, adapter.first_head)


def _attention_width(adapter: Adapter, cfg: dict[str, Any], b: int) -> int:
    """Decoder layer block ``b``'s attention FLOPs per token per attended position
    (``activation_rules.attention_width``; a linear-attention layer's: ``linear_attention_width``)."""
    if _kind_of_layer(adapter, b) == "linear_attention":
        return activation_rules.linear_attention_width(cfg)
    return activation_rules.attention_width(cfg)


def _kind_of_layer(adapter: Adapter, b: int) -> str:
    """The attention kind of decoder layer block ``b`` (``families.layer_types``)."""
    if getattr(adapter.config, "model_type", "") == "gpt2":
        return "full_attention"
    return layer_types(adapter.config)[_layer_of(adapter, b)]


def _window(adapter: Adapter, cfg: dict[str, Any], b: int) -> int:
    """The positions decoder layer block ``b`` attends over at most: its sliding window, or its chunk
    (Llama 4's chunked attention); a linear-attention layer's equivalent
    (``activation_rules.linear_attention_keys``); 0: the whole sequence."""
    kind = _kind_of_layer(adapter, b)
    if kind == "linear_attention":
        return activation_rules.linear_attention_keys(cfg)
    attr = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}.get(kind)
    return int(getattr(adapter.config, attr, 0) or 0) if attr else 0


@functools.lru_cache(maxsize=8)
def _moe_lora_dims(key: str) -> int:
    """A mixture of experts' LoRA parameters at rank 1, as ``peft``'s ``all-linear`` injects them into its
    skeleton: attention, shared experts, and the tensors it targets as such (each of the fused experts'
    own rank-r pair, the router), which differ by family. Seconds for the largest (DeepSeek-V3: 0.48 B
    at rank 1), once per model, when a LoRA run is planned (``ModelShape.lora_dims``)."""
    from fuyou.models.lora import LoraSettings, is_lora

    with warnings.catch_warnings():  # peft's notes on patterns it did not need: nothing for the user
        warnings.simplefilter("ignore")
        adapter = make_adapter(_config(json.loads(key), "model"), LoraSettings(rank=1, alpha=1))
    return sum(p.numel() for name, p in adapter.model.named_parameters() if is_lora(name))


def _is_moe(adapter: Adapter, b: int) -> bool:
    """Whether decoder layer block ``b`` is a mixture of experts, as the skeleton has it: fused expert
    tensors (``[experts, …]``) among its parameters, or the core of a layer split into expert groups."""
    experts = activation_rules.experts_of(adapter.config)
    fused = any(len(p.shape) >= 2 and p.shape[0] == experts and ".experts." in p.key for p in adapter.blocks[b].params)
    return fused or adapter.route_of(b) is not None


def _layer_of(adapter: Adapter, b: int) -> int:
    """The decoder layer block ``b`` belongs to."""
    layer_of = getattr(adapter, "layer_of", None)
    return int(layer_of[b]) if layer_of is not None else b - 1


def _linear_dims(adapter: Adapter, b: int) -> int:
    """Σ (in + out) over dense decoder layer block ``b``'s linear layers (``nn.Linear``, GPT-2's ``Conv1D``):
    a LoRA adapter of rank r on each has r × this many parameters."""
    total = 0
    for _, mod in adapter.modules[b][1]:
        for sub in mod.modules():
            if isinstance(sub, nn.Linear):
                total += sub.in_features + sub.out_features
            elif type(sub).__name__ == "Conv1D":
                conv: Any = sub
                total += int(conv.nx) + int(conv.nf)
    return total


def _config(config: Any, name: str) -> Any:
    """A ``PretrainedConfig`` of ``config`` (one already, or a dict with ``model_type``); a multimodal one's
    text model's (``multimodal.text_config``)."""
    if not isinstance(config, dict):
        return text_config(config)
    from transformers import AutoConfig

    d = dict(config)
    mt = d.pop("model_type", None)
    if not mt:
        archs = d.get("architectures") or []
        mt = "gpt2" if "GPT2LMHeadModel" in archs else None
    if not mt:
        raise ConfigError(f"model config {name!r} names no model_type; pass a complete Hugging Face config.json")
    try:
        return text_config(AutoConfig.for_model(mt, **d))
    except ValueError as e:
        raise ConfigError(f"model config {name!r}: {e}") from None


def load_description(source: str, freeze: tuple[str, ...] = ()) -> ModelShape:
    """The ModelShape of a model directory, a ``config.json`` path, or a named shape.

    Named shapes: ``gpt3-13b`` (40 layers, hidden 5120, LoHan's testbed), ``gpt3-175b``, ``llama-2-7b``,
    ``llama-2-13b``, ``llama-3-8b``, ``llama-3-70b``, ``llama-3.1-405b``, and the mixtures of experts
    ``mixtral-8x7b``, ``mixtral-8x22b``, ``qwen3-235b-a22b``, ``gpt-oss-20b``, ``gpt-oss-120b``,
    ``deepseek-v3-671b``, ``deepseek-v3.2-685b``, ``glm-4.5-355b``, ``llama-4-maverick``, ``qwen3.5-397b-a17b``,
    ``minimax-m2-230b``, ``mistral-small-4-119b``, ``qwen3-next-80b-a3b`` (case-insensitive; ``GPT-3-13B`` works).
    Raises ConfigError if ``source`` is neither an existing path nor a known name, or its config cannot
    be described.
    """
    key = source.lower().replace("_", "-").replace("gpt-3", "gpt3")
    if not os.path.exists(source) and key in NAMED:
        return describe_model(NAMED[key], key, freeze=freeze)
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    if not os.path.isfile(path):
        raise ConfigError(
            f"{source!r} is not a model directory, a config.json or a named shape ({', '.join(sorted(NAMED))})"
        )
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read model config {path}: {e}") from None
    return describe_model(cfg, os.path.basename(os.path.dirname(os.path.abspath(path))) or path, freeze=freeze)
