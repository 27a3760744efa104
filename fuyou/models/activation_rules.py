"""What a block saves for backward and its widest intermediate, per token, by family: the part of a
model's description (``fuyou.models.description``) the skeleton's parameters do not give.

Each figure was measured with the CPU backend's allocation meter (``fuyou.device.cpu_allocations``)
on SmolLM2-135M and tiny Llama, Qwen2, GPT-2 and mixture-of-experts models (torch 2.13,
transformers 5.24); ``bench/bench_device_peak.py`` holds the device-memory model built on them
against the measured peak. Plain Python on a config dict (no torch).

Units: bytes per token in bf16 (``act``: twice that in fp32 unless ``act_fp32`` says otherwise),
elements per token (``work``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Activations:
    """One block's figures (``fuyou.schedule.shapes.BlockShape``'s fields of the same names)."""

    act_bytes_per_token: int = 0
    act_bytes_per_token_per_key: int = 0
    act_fp32_bytes_per_token: int = 0
    work_elems_per_token: int = 0


NONE = Activations()
"""The embedding's and the head's (the loss's logits are modelled apart: ``fuyou.schedule.device_memory``)."""


EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""The names families give their experts per layer (Mixtral; Qwen-MoE, OLMoE; DeepSeek, GLM; ERNIE)."""
TOP_K = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts")
"""The names families give the experts each token is routed to (Gemma 4: ``top_k_experts``)."""


def _first(cfg: Any, names: tuple[str, ...]) -> int:
    get = cfg.get if isinstance(cfg, dict) else (lambda n: getattr(cfg, n, None))
    return int(next((v for v in map(get, names) if v), 0))


def experts_of(cfg: Any) -> int:
    """Experts per mixture-of-experts layer of a config (dict or ``PretrainedConfig``; 0: a dense model)."""
    return _first(cfg, EXPERTS)


ZERO_EXPERTS = ("zero_expert_num",)
"""The names families give their zero-computation experts per layer, routed like experts but returning their
input times the routing weight (LongCat-Flash); their index follows the experts'."""


def zero_experts_of(cfg: Any) -> int:
    """Zero-computation experts per mixture-of-experts layer (a config dict or object; 0: none)."""
    return _first(cfg, ZERO_EXPERTS)


def top_k_of(cfg: Any) -> int:
    """Experts each token is routed to (a config dict or object; 0: a dense model)."""
    return _first(cfg, TOP_K)


def is_moe_layer(cfg: dict[str, Any], k: int) -> bool:
    """Whether decoder layer ``k`` is a mixture of experts by the config alone (Mixtral, Qwen2/3-MoE's
    ``decoder_sparse_step`` and ``mlp_only_layers``, DeepSeek's and GLM's ``first_k_dense_replace``);
    the model description asks the skeleton instead."""
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = k in (cfg.get("mlp_only_layers") or []) or k < (cfg.get("first_k_dense_replace") or 0)
    return bool(experts_of(cfg)) and not dense and not (k + 1) % step


def attention_width(cfg: dict[str, Any]) -> int:
    """A layer's attention forward FLOPs per token per attended position: 2 · heads · (d_qk + d_v), the
    widths of QKᵀ and of the weighted sum of V. Multi-head latent attention (``kv_lora_rank``) has
    ``qk_nope_head_dim`` + ``qk_rope_head_dim`` wide queries and keys, ``v_head_dim`` wide values;
    other families ``head_dim`` (hidden / heads where unset) for both."""
    if cfg.get("model_type") == "gpt2":
        return 4 * cfg["n_embd"]
    heads = cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank"):
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        return 2 * heads * (qk + (cfg.get("v_head_dim") or qk))
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * heads * 2 * d


LINEAR_CHUNK = 64
"""Tokens per chunk of ``transformers``' gated delta rule (``chunk_gated_delta_rule``)."""


def linear_attention_width(cfg: dict[str, Any]) -> int:
    """A linear-attention layer's (Gated DeltaNet: Qwen3.5, Qwen3-Next) FLOPs per token per position
    within its chunk: 2 · value heads · (d_k + d_v), as softmax attention's (``attention_width``)."""
    dk, dv = cfg.get("linear_key_head_dim") or 128, cfg.get("linear_value_head_dim") or 128
    return 2 * (cfg.get("linear_num_value_heads") or cfg["num_attention_heads"]) * (dk + dv)


def linear_attention_keys(cfg: dict[str, Any]) -> int:
    """The positions a linear-attention layer's FLOPs per token equal softmax attention over (the T of
    ``attention_width`` × T): its chunk (``LINEAR_CHUNK``, attended within) plus its recurrent state's
    read and update, 6 · heads · d_k · d_v per token, expressed in those units: 3 · d_k · d_v / (d_k +
    d_v) positions (192 at d = 128). Independent of the sequence length: the layer is linear in it."""
    dk, dv = cfg.get("linear_key_head_dim") or 128, cfg.get("linear_value_head_dim") or 128
    return LINEAR_CHUNK + 3 * dk * dv // (dk + dv)


def layer(cfg: dict[str, Any], k: int, groups: int = 1, moe: bool | None = None) -> Activations:
    """Decoder layer ``k`` (with ``groups`` > 1 and a mixture of experts: its core, the attention,
    router and shared expert, whose expert groups follow it); ``moe``: whether it is a mixture of
    experts (None: ``is_moe_layer``)."""
    if cfg.get("model_type") == "gpt2":
        h = cfg["n_embd"]
        i = cfg.get("n_inner") or 4 * h
        # 54·h bytes at i = 4h: measured exactly in bf16 and fp32
        return Activations(2 * (11 * h + 4 * i), 0, 4 * (11 * h + 4 * i), i)
    h = cfg["hidden_size"]
    i = cfg.get("intermediate_size", 4 * h)
    nh = cfg.get("num_attention_heads", max(1, h // 128))
    kv = (cfg.get("num_key_value_heads") or nh) * (cfg.get("head_dim") or h // nh)
    per_key = 8 * nh if cfg.get("attn_logit_softcapping") else 0  # eager: tanh out, fp32 softmax out, probs
    if not (is_moe_layer(cfg, k) if moe is None else moe):
        # a Llama-like layer saves its norms' fp32 upcasts in bf16 too: 4·(7h + 2kv + 4i) in fp32,
        # 2·(10h + 2kv + 4i) in bf16, both measured exactly on SmolLM2
        return Activations(2 * (10 * h + 2 * kv + 4 * i), per_key, 4 * (7 * h + 2 * kv + 4 * i), i)
    moe_i, top = cfg.get("moe_intermediate_size") or i, top_k_of(cfg) or 2
    n_shared = cfg.get("n_shared_experts") or cfg.get("moe_num_shared_experts") or 0
    shared = cfg.get("shared_expert_intermediate_size") or n_shared * moe_i
    act = 2 * (15 * h + 2 * kv) + 2 * 4 * shared  # 15h: a dense layer's 10h + the router's (measured)
    if groups > 1:  # the experts run in the groups
        return Activations(act, per_key, 0, max(shared, h))
    return Activations(act + 2 * 4 * top * moe_i, per_key, 4 * (9 * h + 2 * kv + 4 * top * moe_i), top * moe_i + shared)


def expert_group(cfg: dict[str, Any], n: int) -> Activations:
    """An expert group of ``n`` of a layer's experts: the family's experts module sorts every token's
    top-k choices, other groups' masked: (2i + 2h) per choice whatever the group, 4i per token routed
    here, 2i + h (measured)."""
    h = cfg["hidden_size"]
    i = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    top = top_k_of(cfg) or 2
    routed_here = top * n / experts_of(cfg)  # this group's routed tokens per token, on average
    return Activations(int(2 * (top * (2 * i + 2 * h) + 4 * i * routed_here + 2 * i + h)), 0, 0, top * i)
