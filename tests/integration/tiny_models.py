"""Tiny random Hugging Face models built in code (no hub) and a plain in-RAM reference trainer."""

from __future__ import annotations

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 96
FAMILIES = (
    "llama",
    "llama_tied",
    "qwen2",
    "gpt2",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "glm4_moe",
    "deepseek_v3",
    "llama4",
    "qwen3_5_moe",
    "qwen3_next",
)
"""One tiny model of each family the adapters support, for tests that go through all of them."""
MOE_FAMILIES = (
    *("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "glm4_moe", "deepseek_v3", "llama4", "qwen3_5_moe"),
    "qwen3_next",
)
"""The mixtures of experts among them."""


def tiny(family: str, layers: int = 2, hidden: int = 64):
    """(config, model) of a tiny random model of ``family``: llama, llama_tied, qwen2, gpt2, llama31
    (Llama 3.1/3.2 RoPE scaling), phi3, gemma, gemma2 and gemma3 (alternating sliding windows), the
    mixtures of experts mixtral, qwen2_moe, qwen3_moe, gpt_oss, glm4_moe and deepseek_v3, and with
    sliding-window attention (a 4-token window) mistral_sw (every layer) and qwen2_sw (the layers
    from the second on, as Qwen2's ``max_window_layers`` = 1 gives)."""
    common = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        num_hidden_layers=layers,
    )
    if family == "llama":
        cfg, cls = LlamaConfig(**common, tie_word_embeddings=False), LlamaForCausalLM
    elif family == "llama_tied":
        cfg, cls = LlamaConfig(**common, tie_word_embeddings=True), LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = Qwen2Config(**common, tie_word_embeddings=False), Qwen2ForCausalLM
    elif family == "llama31":  # Llama 3.1/3.2's RoPE scaling (llama3 rope type), scaled past 8 positions
        rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, rope_theta=10000.0)
        cfg = LlamaConfig(
            **common, tie_word_embeddings=True, rope_scaling=rope | {"original_max_position_embeddings": 8}
        )
        cls = LlamaForCausalLM
    elif family == "phi3":  # fused qkv_proj and gate_up_proj; partial rotary
        cfg = Phi3Config(**common, tie_word_embeddings=False, partial_rotary_factor=0.5, pad_token_id=0)
        cls = Phi3ForCausalLM
    elif family in MOE_FAMILIES:  # mixture of experts: 4 experts, top 2
        from transformers import AutoConfig, AutoModelForCausalLM

        moe = dict(num_experts_per_tok=2, output_router_logits=False, router_aux_loss_coef=0.02)  # Mixtral-8x7B's
        if family == "mixtral":
            moe |= dict(num_local_experts=4)
        elif family in ("glm4_moe", "deepseek_v3"):  # sigmoid router with grouped top-k and a correction
            # bias (no balance loss), a shared expert, the first layer dense; DeepSeek-V3: multi-head
            # latent attention (low-rank q and kv, a decoupled rotary part) with YaRN as published
            del moe["router_aux_loss_coef"]  # not a field of theirs
            moe |= dict(n_routed_experts=4, moe_intermediate_size=hidden, n_shared_experts=1, first_k_dense_replace=1)
            moe |= dict(n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
            if family == "glm4_moe":
                moe |= dict(head_dim=hidden // 4, partial_rotary_factor=0.5, use_qk_norm=True)
            else:
                moe |= MLA
                moe["rope_parameters"] = dict(
                    rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                    mscale_all_dim=1.0, original_max_position_embeddings=16,
                )  # fmt: skip
        elif family == "llama4":  # Llama 4 text: 4-token attention chunks but in the last layer (full
            # attention and no rotary: NoPE), mixtures of experts every 2nd layer (a sigmoid top-1 router
            # scaling the expert's input, a shared expert), attention temperature tuning, L2 q/k norms
            del moe["router_aux_loss_coef"]  # transformers computes no balance loss for it
            moe |= dict(num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2)
            moe |= dict(intermediate_size=hidden, intermediate_size_mlp=2 * hidden, head_dim=hidden // 4)
            moe |= dict(attention_chunk_size=4, no_rope_layers=[1] * (layers - 1) + [0])  # the last layer: NoPE
            moe |= dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        elif family in ("qwen3_5_moe", "qwen3_next"):  # Qwen3.5's text model and Qwen3-Next: Gated DeltaNet
            # linear-attention layers but the last (gated full attention), a shared expert behind its gate;
            # Qwen3.5: interleaved multi-axis RoPE
            moe |= dict(num_experts=4, moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden)
            moe |= dict(head_dim=hidden // 4, linear_num_value_heads=4, linear_num_key_heads=2)
            moe |= dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
            moe |= dict(layer_types=["linear_attention"] * (layers - 1) + ["full_attention"])
            moe |= dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        elif family == "gpt_oss":  # attention sinks, biased router and experts, alternating 4-token windows
            moe |= dict(num_local_experts=4, head_dim=hidden // 4, sliding_window=4, attention_dropout=0.0)
            moe["rope_parameters"] = dict(
                rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                truncate=False, original_max_position_embeddings=16,
            )  # fmt: skip
        else:
            moe |= dict(num_experts=4, moe_intermediate_size=hidden, decoder_sparse_step=1, norm_topk_prob=True)
        if family == "qwen2_moe":
            moe |= dict(shared_expert_intermediate_size=hidden)
        model_type = {"llama4": "llama4_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(family, family)
        cfg = AutoConfig.for_model(model_type, **(common | {k: v for k, v in moe.items() if v is not None}))
        cfg.tie_word_embeddings = False
        cls = AutoModelForCausalLM
        cfg.architectures = [type(cls.from_config(cfg)).__name__]
        torch.manual_seed(0)
        model = cls.from_config(cfg)
        if family == "gpt_oss":  # its biases start at zero: random ones, as a trained checkpoint's, show
            with torch.no_grad():  # each expert's bias lands with its expert
                for name, p in model.named_parameters():
                    if name.endswith("proj_bias"):  # the experts' (not the router's: routing stays even)
                        p.normal_(0.0, 0.02)
        with torch.no_grad():  # a trained checkpoint's routing bias (aux-loss-free balancing), which
            for name, b in model.named_buffers():  # changes which experts are chosen
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.3)
        model.train()
        return cfg, model
    elif family in ("gemma", "gemma2", "gemma3"):  # scaled embeddings, tied; Gemma 2: soft-capping; 3: per-kind RoPE
        from transformers import AutoConfig, AutoModelForCausalLM

        extra = dict(head_dim=16, query_pre_attn_scalar=16, tie_word_embeddings=True)
        if family != "gemma":  # alternating 4-token sliding windows and full attention
            kinds = ["sliding_attention", "full_attention"] * layers
            extra |= dict(sliding_window=4, layer_types=kinds[:layers])
        if family == "gemma2":  # caps low enough to bend this tiny model's scores and logits
            extra |= dict(attn_logit_softcapping=1.0, final_logit_softcapping=2.0)
        if family == "gemma3":
            extra |= dict(rope_local_base_freq=100.0)
        cfg = AutoConfig.for_model(family if family != "gemma3" else "gemma3_text", **common, **extra)
        cfg.architectures = [type(AutoModelForCausalLM.from_config(cfg)).__name__]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager" if family == "gemma2" else "sdpa")
        model.train()
        return cfg, model
    elif family in ("gemma4", "gemma4_moe"):
        return tiny_gemma4(family == "gemma4_moe", layers, hidden)
    elif family == "qwen3_5":  # Qwen3.5's dense text model, tied: Gated DeltaNet layers, then full attention
        from transformers import AutoConfig, AutoModelForCausalLM

        extra = dict(head_dim=hidden // 4, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8)
        extra |= dict(linear_value_head_dim=8, layer_types=["linear_attention"] * (layers - 1) + ["full_attention"])
        cfg = AutoConfig.for_model("qwen3_5_text", **common, **extra, tie_word_embeddings=True, pad_token_id=0)
        cls = AutoModelForCausalLM
        torch.manual_seed(0)
        model = cls.from_config(cfg).float()
        cfg.architectures = [type(model).__name__]
        model.train()
        return cfg, model
    elif family == "mistral_sw":
        cfg, cls = MistralConfig(**common, sliding_window=4, tie_word_embeddings=False), MistralForCausalLM
    elif family == "qwen2_sw":
        cfg = Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=1)
        cls = Qwen2ForCausalLM
    elif family == "gpt2":
        cfg = GPT2Config(
            n_layer=layers,
            n_embd=hidden,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        cls = GPT2LMHeadModel
    elif family in STANDARD_MOE:
        return tiny_standard_moe(family, layers, hidden)
    elif family.removesuffix("_tied") in STANDARD:
        return tiny_standard(family.removesuffix("_tied"), layers, hidden, tied=family.endswith("_tied"))
    else:
        raise ValueError(family)
    cfg.architectures = [cls.__name__]
    torch.manual_seed(0)
    model = cls(cfg)
    model.train()
    return cfg, model


def tiny_gemma4(moe: bool, layers: int = 2, hidden: int = 64):
    """(config, model) of a tiny Gemma 4 text model: 4-token sliding windows then full attention (the last
    layer full, as the family forces), a larger head size on full-attention layers whose keys are also their
    values (``attention_k_eq_v``), proportional partial RoPE there, soft-capped logits, per-layer output
    scalars (0.7, as a trained checkpoint's). Dense and tied; ``moe``: untied, with a 4-expert top-2 mixture
    beside every layer's MLP. No per-layer embeddings and no shared key-value layers (Fuyou refuses them).
    q/k norms at 0.5, as a trained model's: at 1 (the init) this tiny model's attention saturates (scores
    ×1 over a 16-wide head) and a 1e-8 relative change of its initial weights moves 64k elements by more
    than 1e-5 over 5 steps (Llama: 9)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kinds = (["sliding_attention", "full_attention"] * layers)[: layers - 1] + ["full_attention"]
    cfg = AutoConfig.for_model(
        "gemma4_text",
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, num_hidden_layers=layers, head_dim=16, global_head_dim=32,
        sliding_window=4, layer_types=kinds, hidden_size_per_layer_input=0, attention_k_eq_v=True,
        num_global_key_value_heads=1, final_logit_softcapping=2.0, tie_word_embeddings=not moe,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **(dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=hidden // 2) if moe else {}),
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    cfg.architectures = [type(model).__name__]
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.7)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(0.5)
    model.train()
    return cfg, model


STANDARD = (
    "olmo",
    "olmo2",
    "olmo3",
    "glm",
    "glm4",
    "helium",
    "arcee",
    "ministral3",
    "exaone4",
    "hunyuan_v1_dense",
    "starcoder2",
    "ernie4_5",
    "smollm3",
)
"""``model_type`` of each dense family of the standard decoder shape the generic adapter runs with no
code of its own (``fuyou.models.families.STANDARD``)."""


def tiny_standard(model_type: str, layers: int = 2, hidden: int = 64, tied: bool = False):
    """(config, model) of a tiny random model of a standard-shape family, from the family's own config
    class with its defaults but the sizes (and every dropout off: the reference draws other masks)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type](
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, vocab_size=VOCAB, max_position_embeddings=64, num_hidden_layers=layers,
        tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    for k in [k for k in cfg.to_dict() if "dropout" in k]:
        setattr(cfg, k, 0.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    cfg.architectures = [type(model).__name__]
    model.train()
    return cfg, model


STANDARD_MOE = (
    "deepseek_v2",
    "glm4_moe_lite",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "olmoe",
    "flex_olmo",
    "solar_open",
    "minimax_m2",
    "mistral4",
    "dots1",
    "deepseek_v32",
    "exaone_moe",
    "hy_v3",
    "kolibri1",
    "glm_moe_dsa",
    "longcat_flash",
    "afmoe",
)
"""``model_type`` of each mixture-of-experts family of the standard shape the generic adapter runs with no
code of its own (``fuyou.models.families.STANDARD_MOE``)."""
MLA = dict(
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4
)
"""Multi-head latent attention's dimensions in the tiny models (DeepSeek-V2/V3, GLM-4 MoE Lite)."""


def causal_lm(cfg, meta: bool = False):
    """transformers' causal LM of ``cfg`` (random weights; on the meta device with ``meta``): the causal-LM
    auto class, or for a family transformers left out of that mapping (``mistral4`` in 5.24) its
    pretraining one, which names the same ``…ForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForPreTraining

    auto = AutoModelForCausalLM if type(cfg) in AutoModelForCausalLM._model_mapping else AutoModelForPreTraining
    if not meta:
        return auto.from_config(cfg)
    with torch.device("meta"):
        return auto.from_config(cfg)


def tiny_standard_moe(model_type: str, layers: int = 2, hidden: int = 64):
    """(config, model) of a tiny random mixture of experts of a standard-shape family: its own config
    class and defaults but the sizes, 4 experts (2 groups where the router groups them), top 2, every
    dropout off; a routing bias (``e_score_correction_bias``) drawn at random, as a trained one."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    sizes = dict(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, num_hidden_layers=layers, tie_word_embeddings=False,
        num_experts_per_tok=2, moe_intermediate_size=hidden, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    sizes |= (
        MLA if "kv_lora_rank" in CONFIG_MAPPING[model_type]().to_dict() else dict(head_dim=hidden // 4)
    )  # MLA: as many key/value heads as query heads, as published
    cfg = CONFIG_MAPPING[model_type](**sizes)
    if model_type == "longcat_flash":  # a layer of two attention + MLP sublayers beside one mixture of experts:
        # num_hidden_layers counts sublayers (2 × num_layers); its rotary tables are qk_rope_head_dim wide;
        # 2 zero-computation (identity) experts beside the 4 routed ones (256 beside 512 published)
        cfg.num_layers, cfg.head_dim, cfg.zero_expert_num = layers, cfg.qk_rope_head_dim, 2
    for attr, value in dict(num_local_experts=4, num_experts=4, moe_num_experts=4, n_group=2, topk_group=1).items():
        if hasattr(cfg, attr):
            setattr(cfg, attr, value)
    if getattr(cfg, "n_shared_experts", 0) is None:  # dots.llm1's config leaves its shared experts unset
        cfg.n_shared_experts = 1
    if hasattr(cfg, "index_topk"):  # DeepSeek-V3.2, GLM-5: the indexer keeps 4 keys of each query's 16 (sparse)
        cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim = 4, 4, 16
    if getattr(cfg, "mlp_layer_types", None):  # DeepSeek-V3.2, GLM-5: the first layer dense (3 by default)
        cfg.first_k_dense_replace, cfg.mlp_layer_types = 1, ["dense"] + ["sparse"] * (layers - 1)
    if hasattr(cfg, "indexer_types"):  # GLM-5: every other layer reuses the keys the layer before it picked
        cfg.indexer_types = ["full" if i % 2 == 0 else "shared" for i in range(layers)]
    for k in [k for k in cfg.to_dict() if "dropout" in k]:
        setattr(cfg, k, 0.0)
    torch.manual_seed(0)
    model = causal_lm(cfg).float()
    cfg.architectures = [type(model).__name__]
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.train()
    return cfg, model


def hf_balance(cfg) -> str | None:
    """``global`` where the family's transformers model has a balance loss (``load_balancing_loss_func``
    and a coefficient), else None (DeepSeek-V3, GLM-4.5, Llama 4: none): the reference's ``balance``."""
    import sys

    cls = type(causal_lm(cfg, meta=True))
    has = hasattr(sys.modules[cls.__module__], "load_balancing_loss_func")
    return "global" if has and getattr(cfg, "router_aux_loss_coef", 0.0) else None


def batches(n: int, batch: int = 4, seq: int = 16, seed: int = 1):
    """``n`` (input_ids, labels) pairs; some labels masked with -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        labels = ids.clone()
        labels[0, : seq // 3] = -100
        out.append((ids, labels))
    return out


ILL_CONDITIONED = 1e-3
"""An element whose gradient is below this share of its tensor's largest: Adam divides it by its own
scale, so fp32 rounding of the gradient (1e-7 relative to the largest) becomes ~1e-4 of a step."""


def reference_steps(
    model, data, K: int, lr: float, wd: float, clip: float = 0.0, lrs=None, balance=None, auxes=None, ill=None
):
    """Plain PyTorch + torch.optim.AdamW, ordinary accumulation over K micro-batches; per-step losses.

    ``balance`` (a mixture of experts): ``micro`` adds each micro-batch's balance loss, as the HF
    model computes it, averaged over the K micro-batches; ``global`` adds the balance loss of the
    whole batch, ``transformers``' own ``load_balancing_loss_func`` over every micro-batch's router
    logits at once. Either is weighted by ``router_aux_loss_coef``; ``auxes`` (a list) receives each
    step's unweighted balance loss. ``ill`` (a dict) receives, per parameter, the elements whose
    gradient was below 1e-3 of the tensor's largest at some step (``ILL_CONDITIONED``)."""
    import sys

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    losses = []
    for i, (ids, labels) in enumerate(data):
        if lrs:
            for g in opt.param_groups:
                g["lr"] = lrs[i]
        n_items = int((labels[:, 1:] != -100).sum())
        opt.zero_grad()
        total = 0.0
        if balance is None:
            for mi, ml in zip(ids.chunk(K), labels.chunk(K)):
                loss = model(input_ids=mi, labels=ml, num_items_in_batch=n_items).loss
                loss.backward()
                total += loss.item()
        else:
            cfg = model.config
            assert getattr(cfg, "router_aux_loss_coef", 0.0), "this family defines no balance loss: balance=None"
            lbl = sys.modules[type(model).__module__].load_balancing_loss_func
            experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
            ces, routers, micro = [], [], []
            for mi, ml in zip(ids.chunk(K), labels.chunk(K)):
                out = model(input_ids=mi, output_router_logits=True)
                ces.append(model.loss_function(out.logits, ml, cfg.vocab_size, num_items_in_batch=n_items))
                routers.append(out.router_logits)
                micro.append(out.aux_loss)
            if balance == "global":
                aux = lbl(tuple(torch.cat(layer) for layer in zip(*routers)), experts, cfg.num_experts_per_tok)
            else:
                aux = sum(micro) / K
            loss = sum(ces) + cfg.router_aux_loss_coef * aux
            loss.backward()
            total = loss.item()
            if auxes is not None:
                auxes.append(aux.item())
        if ill is not None:
            for name, p in model.named_parameters():
                if p.grad is None:  # frozen (requires_grad False)
                    continue
                g = p.grad.abs()
                small = (g < ILL_CONDITIONED * g.max()) & (g > 0)  # exact zeros stay exact (unrouted experts)
                ill[name] = ill[name] | small if name in ill else small
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
    return losses


def cli_inputs(tmp) -> tuple[str, str]:
    """(a tiny random HF model directory, a 60-record JSONL text file) in ``tmp``, for CLI runs."""
    import json

    from fuyou.run.demo import _random_model

    model = _random_model(str(tmp / "tiny"))
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f{i}(x): return x * {i} + {i * i}"}) + "\n" for i in range(60)))
    return model, str(data)


def exported_weights(out: str) -> dict:
    """Every tensor of the HF model a run exported to ``out/model``."""
    import os

    from safetensors.torch import load_file

    d = os.path.join(out, "model")
    tensors = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(d, f)))
    return tensors
