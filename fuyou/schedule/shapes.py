"""A model as the planner sees it: per block, parameter count, FLOPs and activation bytes per token.

Plain data (no torch), so the cost model and the search run without a model. The shapes are made
from the model itself by ``fuyou.models.description`` (its meta-device skeleton, the engine's own
blocks and store layout): one description for the engine and the planner. ``NAMED`` holds published
configs (``fuyou plan GPT-3-13B``) described the same way.

Units: parameters in elements, FLOPs per token (2 per multiply-add), bytes per token in bf16.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from fuyou.errors import ConfigError
from fuyou.schedule.device_memory import BWD_WORK, FWD_WORK, LAZY_SHARE, BlockMemory, DeviceBlock
from fuyou.schedule.shards import shard_len
from fuyou.schedule.sizing import Footprint
from fuyou.schedule.state_format import StateFormat

NAMED = {
    # LoHan's GPT-3 13B shape (GPT-2 architecture: LayerNorm, GELU MLP 4h, tied head, learned positions)
    "gpt3-13b": {
        "model_type": "gpt2",
        "n_layer": 40,
        "n_embd": 5120,
        "n_head": 40,
        "vocab_size": 50257,
        "n_positions": 2048,
    },
    "gpt3-175b": {
        "model_type": "gpt2",
        "n_layer": 96,
        "n_embd": 12288,
        "n_head": 96,
        "vocab_size": 50257,
        "n_positions": 2048,
    },
    "llama-2-7b": {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
    },
    "llama-2-13b": {
        "model_type": "llama",
        "num_hidden_layers": 40,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "vocab_size": 32000,
    },
    "llama-3-8b": {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    },
    "llama-3-70b": {
        "model_type": "llama",
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    },
    "llama-3.1-405b": {
        "model_type": "llama",
        "num_hidden_layers": 126,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "mixtral-8x22b": {
        "model_type": "mixtral",
        "num_hidden_layers": 56,
        "hidden_size": 6144,
        "intermediate_size": 16384,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "vocab_size": 32768,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 94,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "gpt-oss-120b": {  # openai/gpt-oss-120b's config.json
        "model_type": "gpt_oss",
        "num_hidden_layers": 36,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 201088,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "tie_word_embeddings": False,
    },
}
NAMED["gpt-oss-20b"] = NAMED["gpt-oss-120b"] | {"num_hidden_layers": 24, "num_local_experts": 32}
"""openai/gpt-oss-20b's config.json: GPT-OSS-120B's with 24 layers of 32 experts."""
NAMED["deepseek-v3-671b"] = {  # deepseek-ai/DeepSeek-V3's config.json (its multi-token-prediction layer aside)
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
}
NAMED["deepseek-v3.2-685b"] = NAMED["deepseek-v3-671b"] | {  # deepseek-ai/DeepSeek-V3.2's config.json: V3's shape
    # and each layer's lightning indexer (0.85 B parameters, never trained: ``families.UNTRAINED``); 685 B counts
    # its multi-token-prediction layer, which this shape (as V3's) leaves aside
    "model_type": "deepseek_v32",
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}
NAMED["glm-5-744b"] = {  # zai-org/GLM-5: transformers' GlmMoeDsaConfig defaults, documented as its config (its
    # multi-token-prediction layer aside, as DeepSeek-V3's); every layer runs its own indexer (never trained)
    "model_type": "glm_moe_dsa",
    "num_hidden_layers": 78,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "vocab_size": 154880,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "routed_scaling_factor": 2.5,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "tie_word_embeddings": False,
}
NAMED["qwen3.5-397b-a17b"] = {  # Qwen/Qwen3.5-397B-A17B's text model (its model card's architecture table)
    "model_type": "qwen3_5_moe_text",
    "num_hidden_layers": 60,  # 15 × (3 Gated DeltaNet layers + 1 full attention), every one a mixture of experts
    "hidden_size": 4096,
    "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 64,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "vocab_size": 248320,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "tie_word_embeddings": False,
}
NAMED["llama-4-maverick"] = {  # meta-llama/Llama-4-Maverick-17B-128E's text_config
    "model_type": "llama4_text",
    "num_hidden_layers": 48,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 202048,
    "num_local_experts": 128,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2,
    "attention_chunk_size": 8192,
    "use_qk_norm": False,
    "tie_word_embeddings": False,
}
NAMED["glm-4.5-355b"] = {  # zai-org/GLM-4.5's config.json (its multi-token-prediction layer aside)
    "model_type": "glm4_moe",
    "num_hidden_layers": 92,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "use_qk_norm": True,
    "attention_bias": True,
    "vocab_size": 151552,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
}

NAMED["minimax-m2-230b"] = {  # MiniMaxAI/MiniMax-M2's config.json (its multi-token-prediction modules aside)
    "model_type": "minimax_m2",
    "num_hidden_layers": 62,
    "hidden_size": 3072,
    "intermediate_size": 1536,  # each expert's
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,  # the published config's rotary_dim 64
    "vocab_size": 200064,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    "tie_word_embeddings": False,
}

NAMED["mistral-small-4-119b"] = {  # mistralai/Mistral-Small-4-119B-2603's text model (Mistral4Config's defaults)
    "model_type": "mistral4",
    "num_hidden_layers": 36,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 256,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 131072,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 0,
    "tie_word_embeddings": False,
}

NAMED["qwen3-next-80b-a3b"] = {  # Qwen/Qwen3-Next-80B-A3B's config.json (Qwen3NextConfig's defaults)
    "model_type": "qwen3_next",
    "num_hidden_layers": 48,  # 12 × (3 Gated DeltaNet layers + 1 gated full attention), every one a mixture of experts
    "hidden_size": 2048,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "vocab_size": 151936,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class BlockShape:
    """One streamed block: owned parameter elements (store layout, with alignment gaps) and costs."""

    name: str
    kind: str
    """``embed`` (the embedding, or one of its vocabulary groups: ``fuyou.schedule.vocab``) | ``layer`` |
    ``experts`` (an expert group of a split mixture-of-experts layer) | ``head``."""
    numel: int
    """Elements of the block's flat vectors (as ``ModelLayout.numel``)."""
    matmul_flops_per_token: int
    """Forward FLOPs per token of the matmuls (2 per multiply-add; a tied head counted here)."""
    act_bytes_per_token: int = 0
    """Bytes the block saves for backward per token (bf16), what ``keep``/``swap_*`` hold or move."""
    borrows: tuple[str, ...] = ()
    act_bytes_per_token_per_key: int = 0
    """More saved bytes per token for each position it attends to (bf16): eager attention's
    ``heads × T × T`` scores (soft-capped attention: ``fuyou.models.adapters.attention_kernel``)."""
    linear_dims: int = 0
    """LoRA parameters at rank 1 of ``peft``'s ``all-linear`` on the block: Σ (in + out) over its linear
    layers (``nn.Linear``/``Conv1D``); r × this at rank r. 0 in a mixture of experts, whose adapters
    the shape counts whole (``ModelShape.lora_dims``)."""
    keeps_input: bool = True
    """Whether backward needs the block's input (kept, or offloaded by ``recompute_cpu``): not an
    expert group's, which adds to its input (``fuyou.engine.activations``)."""
    frozen: bool = False
    """Frozen whole (``--freeze``): no optimizer state, no gradient leaves the device, never written."""
    frozen_numel: int = 0
    """Elements of the block's read-only part: parameters ``--freeze`` freezes in a block that trains
    (``ModelLayout.frozen_numel``): read like weights, no state, gradient or writes; ``numel`` is the rest."""
    frozen_matmul_flops_per_token: int = 0
    """The part of ``matmul_flops_per_token`` whose weights that read-only part holds (no weight gradient)."""
    work_elems_per_token: int = 0
    """Elements per token of the block's widest intermediate (a gated MLP's intermediate size): what
    its forward and backward transients scale with (``fuyou.schedule.device_memory``)."""
    bwd_fixed_elems: int = 0
    """Elements of a transient backward makes whatever the tokens: each weight's gradient is made
    fresh, then added into the block's gradient buffer, so the largest weight tensor's size (an MLP
    matrix; a mixture of experts' fused ``[E, 2I, h]`` gate_up_proj)."""
    attn_flops_per_key: int = 0
    """A layer's attention forward FLOPs per token per position it attends to: 2 · heads · (d_qk + d_v)
    (QKᵀ and the weighted sum of V). 4 · hidden for multi-head attention; multi-head latent attention's
    heads are wider (DeepSeek-V3: 2 · 128 · (192 + 128) = 81,920 against 4 · 7168 = 28,672); GPT-OSS's 64
    heads of 64 are 4,096 wide over a 2,880 hidden. 0: 4 · hidden (a shape made by hand)."""
    window: int = 0
    """Positions a sliding-window layer attends to (0: all of the sequence)."""
    act_fp32_bytes_per_token: int = 0
    """Saved bytes per token in fp32 where not twice the bf16 figure (0: twice it). A Llama-like layer
    saves its norms' fp32 upcasts in bf16 too: 4·(7h + 2kv + 4i) in fp32, 2·(10h + 2kv + 4i) in bf16,
    both measured exactly on SmolLM2 with the CPU backend's allocation meter."""

    def saved_bytes_per_token(self, compute_bytes: int, seq_len: int) -> float:
        """Bytes the block saves for backward per token at ``compute_bytes`` per element and ``seq_len``."""
        per_key = self.act_bytes_per_token_per_key * seq_len * compute_bytes / 2
        if compute_bytes == 4 and self.act_fp32_bytes_per_token:
            return self.act_fp32_bytes_per_token + per_key
        return self.act_bytes_per_token * compute_bytes / 2 + per_key

    def fwd_flops_per_token(self, hidden: int, seq_len: int) -> int:
        """Forward FLOPs per token including a layer's attention (``attn_flops``)."""
        return self.matmul_flops_per_token + self.attn_flops(hidden, seq_len)

    def attn_flops(self, hidden: int, seq_len: int) -> int:
        """A layer's attention forward FLOPs per token at ``seq_len``: ``attn_flops_per_key`` (4 · hidden
        if unset) times the positions attended to, the whole sequence or the window, without causal
        halving (PaLM's accounting); 0 for other blocks."""
        if self.kind != "layer":
            return 0
        keys = min(seq_len, self.window) if self.window else seq_len
        return (self.attn_flops_per_key or 4 * hidden) * keys


@dataclass(frozen=True)
class ModelShape:
    """A model's blocks and the dimensions the cost model needs."""

    name: str
    blocks: tuple[BlockShape, ...]
    hidden: int
    layers: int
    vocab: int
    experts: int = 0
    """Experts per mixture-of-experts layer (0: a dense model)."""
    expert_groups: int = 1
    """Expert-group blocks each mixture-of-experts layer is split into (``Plan.expert_groups``)."""
    vocab_groups: int = 1
    """Blocks the embedding and the LM head are each split into by vocabulary rows (``Plan.vocab_groups``)."""
    held: tuple[int, int] = (0, 0)
    """Elements of the family's persistent buffers (router biases: ``fuyou.models.blocks.BufferSpec``),
    kept in fp32 and in the compute dtype, which live on the device through the run (``held_bytes``)."""
    source: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """The config dict the shape was made from."""
    describer: Callable[[int, int], ModelShape] | None = dataclasses.field(default=None, compare=False, repr=False)
    lora_dims: Callable[[], int] | None = dataclasses.field(default=None, compare=False, repr=False)
    """A mixture of experts' LoRA parameters at rank 1 as ``peft``'s ``all-linear`` injects them (its fused
    expert tensors and routers included), counted when asked: building the injected skeleton takes
    seconds on the largest (``fuyou.models.description._moe_lora_dims``); None: Σ ``linear_dims``."""
    """The same model at (expert groups, vocabulary groups): ``fuyou.models.description.describe``."""
    probe: Callable[[int, int, int, int], BlockMemory | None] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    """Block ``b``'s device memory measured on the model's own modules at (b, compute bytes, sequence
    length, micro-batch), or None where they cannot run on fake tensors (``fuyou.models.activation_probe``)."""
    _device: dict[tuple, list[DeviceBlock]] = dataclasses.field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    """``device_blocks`` by its arguments (the planner asks thousands of times per search)."""

    def held_bytes(self, compute_bytes: int) -> int:
        """Device bytes of the family's persistent buffers (``held``) at ``compute_bytes`` per element."""
        return 4 * self.held[0] + compute_bytes * self.held[1]

    def memory(self, b: int, compute_bytes: int, seq_len: int, micro_batch: int = 1) -> BlockMemory:
        """What block ``b`` holds on the device while it computes, at ``compute_bytes`` per element on a
        micro-batch of ``micro_batch × seq_len`` tokens: measured (``probe``), else the family's rule (``BlockShape``'s activation fields:
        ``FWD_WORK``/``BWD_WORK`` × its widest intermediate, a hidden state for a forward with autograd,
        ``LAZY_SHARE`` of what a swapped block saves back at once)."""
        measured = self.probe(b, compute_bytes, seq_len, micro_batch) if self.probe is not None else None
        if measured is not None:
            return measured
        blk, cb = self.blocks[b], compute_bytes
        if blk.kind == "head":  # the loss's logits, their fp32 upcast and gradients (``sizing.loss_chunk_tokens``)
            return BlockMemory(0.0, 0.0, 0.0, 0.0, (8 + 2 * cb) * self.vocab, 0.0, 0.0, 0.0)
        saved, bwd = blk.saved_bytes_per_token(cb, seq_len), BWD_WORK.get(cb, 2.5) * cb * blk.work_elems_per_token
        x = self.hidden * cb if blk.kind in ("layer", "experts") else 0.0
        return BlockMemory(
            saved, FWD_WORK * cb * blk.work_elems_per_token, 0.0, x, bwd, cb * blk.bwd_fixed_elems,
            LAZY_SHARE * (saved + x) + bwd, cb * blk.bwd_fixed_elems,
        )  # fmt: skip

    def route_holders(self) -> list[int]:
        """The last expert group of each split layer: each layer keeps one ``tokens × hidden`` route
        from its core's forward to its backward, on the device, or in host memory when this
        block's policy is ``recompute_cpu`` (``fuyou.engine.activations``)."""
        return [
            b
            for b, blk in enumerate(self.blocks)
            if blk.kind == "experts" and (b + 1 == len(self.blocks) or self.blocks[b + 1].kind != "experts")
        ]

    def split(self, groups: int) -> ModelShape:
        """This model with its mixture-of-experts layers split into ``groups`` expert groups."""
        if groups == self.expert_groups:
            return self
        if not self.experts:
            raise ConfigError(f"{self.name} has no experts to split into {groups} groups")
        return self._again(groups, self.vocab_groups)

    def split_vocab(self, groups: int) -> ModelShape:
        """This model with its embedding and LM head each split into ``groups`` blocks of vocabulary rows
        (the engine's ``fuyou.models.blocks.split_vocab``). Raises ConfigError for a tied embedding (the head borrows
        the whole matrix) or a family the engine does not split (GPT-2)."""
        if groups == self.vocab_groups:
            return self
        if self.blocks[-1].borrows or self.source.get("model_type") == "gpt2":
            raise ConfigError(f"{self.name}'s embedding (tied, or GPT-2's) cannot be split into vocabulary groups")
        return self._again(self.expert_groups, groups)

    def _again(self, expert_groups: int, vocab_groups: int) -> ModelShape:
        """The same model at other group counts (``describer``). Raises ConfigError for a shape made by
        hand (no ``describer``)."""
        if self.describer is None:
            raise ConfigError(f"{self.name} was not described from a model config: it cannot be split again")
        return self.describer(expert_groups, vocab_groups)

    @property
    def signature(self) -> str:
        """``hidden×layers×vocab``: which model a profile's measurements were taken on."""
        return f"{self.hidden}x{self.layers}x{self.vocab}"

    @property
    def params(self) -> int:
        """Elements of every parameter, frozen or not (store layout)."""
        return sum(b.numel + b.frozen_numel for b in self.blocks)

    def lora_params(self, rank: int) -> int:
        """Parameters of LoRA adapters of ``rank`` on every linear layer (``all-linear``; a mixture of
        experts: as ``peft`` injects them, ``lora_dims``)."""
        return rank * (self.lora_dims() if self.lora_dims is not None else sum(b.linear_dims for b in self.blocks))

    def train_flops_per_token(self, seq_len: int, lora_base: bool = False) -> int:
        """Model FLOPs per token, what achieved TFLOPS and MFU are computed from (the run's report too):
        6 · N_matmul + 3 · Σ attention. N_matmul counts every weight used in a matrix multiply (linear
        layers and the LM head, tied or not; embedding lookups and norms excluded); the second term
        is attention's QKᵀ and AV forward per layer (``BlockShape.attn_flops``: 4 · d · T for multi-head
        attention, wider heads for latent attention, the window for sliding layers), × 3 for forward +
        backward, without causal halving (PaLM's MFU accounting: 6 · N + 12 · L · d · T). Recomputation is not counted: model FLOPs,
        not hardware FLOPs. A frozen base (LoRA, ``frozen``) computes no weight gradients: 4 · N_matmul
        (the adapters' own FLOPs are not counted); nor does a block frozen whole (``BlockShape.frozen``),
        nor a block's read-only part (``BlockShape.frozen_matmul_flops_per_token``)."""
        per = (
            sum(
                4 * b.matmul_flops_per_token
                if lora_base or b.frozen
                else 6 * b.matmul_flops_per_token - 2 * b.frozen_matmul_flops_per_token
                for b in self.blocks
            )
            // 2
        )
        return per + 3 * sum(b.attn_flops(self.hidden, seq_len) for b in self.blocks)

    def sharded(self, world: int) -> ModelShape:
        """What one of ``world`` data-parallel ranks stores, streams and updates: every block's numel
        is its largest shard's (``fuyou.schedule.shards.shard_len``); FLOPs and activations stay
        the whole model's (every rank computes on whole, gathered blocks). ``self`` on one rank."""
        if world == 1:
            return self
        blocks = tuple(
            dataclasses.replace(
                b,
                numel=shard_len(b.numel, world),
                frozen_numel=shard_len(b.frozen_numel, world) if b.frozen_numel else 0,
            )
            for b in self.blocks
        )
        return dataclasses.replace(self, blocks=blocks)

    def device_blocks(
        self, compute_bytes: int, seq_len: int, micro_batch: int, world: int = 1, lora_base: bool = False
    ) -> list[DeviceBlock]:
        """Each block as device memory sees it (``fuyou.schedule.device_memory``) at ``compute_bytes``
        per element on micro-batches of ``micro_batch × seq_len`` tokens: its weights (the head's with the blocks it borrows; with
        ``world`` ranks gathered, plus the shard they come from), its gradients (none for a block
        frozen whole, or any with ``frozen``: a LoRA run's base), saved bytes and widest
        intermediate per token."""
        key = (compute_bytes, seq_len, micro_batch, world, lora_base)
        if key not in self._device:
            self._device[key] = self._device_blocks(compute_bytes, seq_len, micro_batch, world, lora_base)
        return list(self._device[key])

    def _device_blocks(
        self, compute_bytes: int, seq_len: int, micro_batch: int, world: int, lora_base: bool
    ) -> list[DeviceBlock]:
        cb, own = compute_bytes, self.sharded(world).blocks
        names = [b.name for b in self.blocks]

        def wg(i: int) -> tuple[int, int]:
            blk, sh = self.blocks[i], own[i]
            grad = 0 if lora_base or blk.frozen else cb * (sh.numel if world > 1 else blk.numel)
            if world == 1:
                return cb * (blk.numel + blk.frozen_numel), grad
            return (world + 1) * (cb * sh.numel + cb * sh.frozen_numel), (world + 1) * grad

        out, holders = [], set(self.route_holders())
        lenders = set(self.blocks[-1].borrows)
        for i, blk in enumerate(self.blocks):
            w, g = wg(i)
            for o in blk.borrows:
                bw, bg = wg(names.index(o))
                w, g = w + bw, g + bg
            mem = self.memory(i, cb, seq_len, micro_batch)
            out.append(
                DeviceBlock(
                    blk.name, blk.kind, w, g, mem, blk.keeps_input or i in holders, blk.name in lenders,
                    blk.matmul_flops_per_token // (2 * self.hidden) if blk.kind == "head" else 0,
                )
            )  # fmt: skip
        return out

    def footprint(self, compute_bytes: int, state_format: StateFormat) -> Footprint:
        """What host-memory sizing (``fuyou.schedule.sizing``) needs: weights of ``compute_bytes`` per
        element (the store's 64-byte tensor gaps counted at bf16's 32 elements: exact for bf16, a few
        bytes high for fp32), and state stored as ``state_format``."""
        names = [b.name for b in self.blocks]
        return Footprint(
            tuple(compute_bytes * b.numel for b in self.blocks),
            tuple(b.numel for b in self.blocks),
            compute_bytes,
            state_format,
            tuple(names.index(o) for o in self.blocks[-1].borrows),
            frozen=tuple(i for i, b in enumerate(self.blocks) if b.frozen),
            frozen_numels=tuple(b.frozen_numel for b in self.blocks)
            if any(b.frozen_numel for b in self.blocks)
            else (),
        )
