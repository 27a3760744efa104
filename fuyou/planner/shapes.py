"""A model as the planner sees it: per block, parameter count, FLOPs and activation bytes per token.

Pure Python (no torch, no transformers), so ``fuyou plan`` runs in milliseconds for any model size
from a ``config.json`` alone. The block list mirrors ``fuyou.models.adapters`` (embed, one block per
decoder layer, head; a tied LM head borrows the embedding); ``tests/unit/planner`` checks the
parameter counts and FLOPs against the adapter on small configs.

Units: parameters in elements, FLOPs per token (2 per multiply-add), bytes per token in bf16.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fuyou.errors import ConfigError
from fuyou.schedule.device_memory import DeviceBlock
from fuyou.schedule.experts import group_ranges
from fuyou.schedule.shards import shard_len
from fuyou.schedule.sizing import Footprint
from fuyou.schedule.vocab import head_block_name, row_ranges, vocab_block_name

TENSOR_ALIGN_ELEMS = 32
"""The store packs each tensor at 64-byte alignment: 32 bf16 elements."""

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
}

Freezer = Callable[[int], Mapping[str, tuple[float, float]]]
"""What ``--freeze`` freezes, given a model's expert-group count: for each block name that it touches,
(share of the block's elements frozen, share of its matmul FLOPs frozen); an element share of 1 is a
block frozen whole. Made from the engine's own rule by ``fuyou.run.plan_choice.frozen_parts``."""


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
    """Σ (in + out) over the block's linear layers (``nn.Linear``/``Conv1D``): a LoRA adapter of rank r
    on every one has r × this many parameters (``peft``'s ``all-linear``; dense families: Fuyou
    refuses LoRA on a mixture of experts)."""
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
        """Forward FLOPs per token including attention scores for layers (4·d·T, no causal halving)."""
        return self.matmul_flops_per_token + (4 * hidden * seq_len if self.kind == "layer" else 0)


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
    source: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """The config the shape was made from (``split``)."""
    freezer: Freezer | None = dataclasses.field(default=None, compare=False, repr=False)
    """What ``--freeze`` freezes (``freeze``), applied again to a ``split``."""

    def freeze(self, freezer: Freezer) -> ModelShape:
        """This model with what ``freezer`` says of its blocks at its expert-group count frozen: a
        block at share 1 frozen whole, one at a smaller share with that share of its elements (and
        of its matmul FLOPs) moved to its read-only part (``BlockShape.frozen_numel``)."""
        parts = freezer(self.expert_groups)
        blocks = []
        for b in self.blocks:
            elems, flops = parts.get(b.name, (0.0, 0.0))
            if elems >= 1.0:
                blocks.append(dataclasses.replace(b, frozen=True))
            elif elems > 0.0:
                fz = round(b.numel * elems)
                fl = round(b.matmul_flops_per_token * flops)
                blocks.append(
                    dataclasses.replace(b, numel=b.numel - fz, frozen_numel=fz, frozen_matmul_flops_per_token=fl)
                )
            else:
                blocks.append(b)
        return dataclasses.replace(self, blocks=tuple(blocks), freezer=freezer)

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
        split = _llama(self.source, self.name, groups, self.vocab_groups)
        return split.freeze(self.freezer) if self.freezer is not None else split

    def split_vocab(self, groups: int) -> ModelShape:
        """This model with its embedding and LM head each split into ``groups`` blocks of vocabulary rows
        (the engine's ``fuyou.models.blocks.split_vocab``). Raises ConfigError for a tied embedding (the head borrows
        the whole matrix) or a family the engine does not split (GPT-2)."""
        if groups == self.vocab_groups:
            return self
        if self.blocks[-1].borrows or not self.source or self.source.get("model_type") == "gpt2":
            raise ConfigError(f"{self.name}'s embedding (tied, or GPT-2's) cannot be split into vocabulary groups")
        split = _llama(self.source, self.name, self.expert_groups, groups)
        return split.freeze(self.freezer) if self.freezer is not None else split

    @property
    def signature(self) -> str:
        """``hidden×layers×vocab``: which model a profile's measurements were taken on."""
        return f"{self.hidden}x{self.layers}x{self.vocab}"

    @property
    def params(self) -> int:
        """Elements of every parameter, frozen or not (store layout)."""
        return sum(b.numel + b.frozen_numel for b in self.blocks)

    def lora_params(self, rank: int) -> int:
        """Parameters of LoRA adapters of ``rank`` on every linear layer (``all-linear``)."""
        return rank * sum(b.linear_dims for b in self.blocks)

    def train_flops_per_token(self, seq_len: int, frozen: bool = False) -> int:
        """Model FLOPs per token, what achieved TFLOPS and MFU are computed from (the run's report too):
        6 · N_matmul + 12 · L · d · T. N_matmul counts every weight used in a matrix multiply (linear
        layers and the LM head, tied or not; embedding lookups and norms excluded); the second term
        is attention's QKᵀ and AV, 2 · 2 · L · d · T per token forward, × 3 for forward + backward,
        without causal halving (PaLM's MFU accounting). Recomputation is not counted: model FLOPs,
        not hardware FLOPs. A frozen base (LoRA, ``frozen``) computes no weight gradients: 4 · N_matmul
        (the adapters' own FLOPs are not counted); nor does a block frozen whole (``BlockShape.frozen``),
        nor a block's read-only part (``BlockShape.frozen_matmul_flops_per_token``)."""
        per = (
            sum(
                4 * b.matmul_flops_per_token
                if frozen or b.frozen
                else 6 * b.matmul_flops_per_token - 2 * b.frozen_matmul_flops_per_token
                for b in self.blocks
            )
            // 2
        )
        return per + 12 * self.layers * self.hidden * seq_len

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
        self, compute_bytes: int, seq_len: int, world: int = 1, frozen: bool = False
    ) -> list[DeviceBlock]:
        """Each block as device memory sees it (``fuyou.schedule.device_memory``) at ``compute_bytes``
        per element and ``seq_len``: its weights (the head's with the blocks it borrows; with
        ``world`` ranks gathered, plus the shard they come from), its gradients (none for a block
        frozen whole, or any with ``frozen``: a LoRA run's base), saved bytes and widest
        intermediate per token."""
        cb, own = compute_bytes, self.sharded(world).blocks
        names = [b.name for b in self.blocks]

        def wg(i: int) -> tuple[int, int]:
            blk, sh = self.blocks[i], own[i]
            grad = 0 if frozen or blk.frozen else cb * (sh.numel if world > 1 else blk.numel)
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
            out.append(
                DeviceBlock(
                    blk.name, blk.kind, w, g, blk.saved_bytes_per_token(cb, seq_len), cb * blk.work_elems_per_token,
                    blk.keeps_input or i in holders, blk.name in lenders, cb * blk.bwd_fixed_elems,
                    blk.matmul_flops_per_token // (2 * self.hidden) if blk.kind == "head" else 0,
                )
            )  # fmt: skip
        return out

    def footprint(self, compute_bytes: int, state_bytes_per_param: int) -> Footprint:
        """What host-memory sizing (``fuyou.schedule.sizing``) needs: weights of ``compute_bytes`` per
        element (the store's 64-byte tensor gaps counted at bf16's 32 elements: exact for bf16, a few
        bytes high for fp32), and state of ``state_bytes_per_param``."""
        names = [b.name for b in self.blocks]
        return Footprint(
            tuple(compute_bytes * b.numel for b in self.blocks),
            tuple(b.numel for b in self.blocks),
            compute_bytes,
            state_bytes_per_param,
            tuple(names.index(o) for o in self.blocks[-1].borrows),
            frozen=tuple(i for i, b in enumerate(self.blocks) if b.frozen),
            frozen_numels=tuple(b.frozen_numel for b in self.blocks)
            if any(b.frozen_numel for b in self.blocks)
            else (),
        )


def _aligned(*shapes: tuple[int, ...]) -> int:
    """Elements of tensors packed at 32-element alignment (the last one unpadded)."""
    sizes = [_prod(s) for s in shapes]
    return sum(-(-n // TENSOR_ALIGN_ELEMS) * TENSOR_ALIGN_ELEMS for n in sizes[:-1]) + sizes[-1]


def _prod(s: tuple[int, ...]) -> int:
    out = 1
    for x in s:
        out *= x
    return out


def _llama(cfg: dict, name: str, groups: int = 1, vocab_groups: int = 1) -> ModelShape:
    h, L, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    i = cfg.get("intermediate_size", 4 * h)
    nh = cfg.get("num_attention_heads", max(1, h // 128))
    kvh = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    mt = cfg.get("model_type", "llama")
    qwen2 = mt in ("qwen2", "qwen2_moe")
    qkv_bias = qwen2 or bool(cfg.get("attention_bias", False))
    o_bias, mlp_bias = bool(cfg.get("attention_bias", False)) and not qwen2, bool(cfg.get("mlp_bias", False))
    tied = bool(cfg.get("tie_word_embeddings", False))
    q, kv = nh * hd, kvh * hd
    attn = [(q, h)] + ([(q,)] if qkv_bias else []) + [(kv, h)] + ([(kv,)] if qkv_bias else [])
    attn += [(kv, h)] + ([(kv,)] if qkv_bias else []) + [(h, q)] + ([(h,)] if o_bias else [])
    if mt in ("qwen3", "qwen3_moe", "gemma3_text"):  # q_norm, k_norm
        attn += [(hd,), (hd,)]
    norms = [(h,)] * (4 if mt in ("gemma2", "gemma3_text") else 2)  # Gemma 2/3: pre/post attention and MLP
    per_key = 8 * nh if cfg.get("attn_logit_softcapping") else 0  # eager: tanh out, fp32 softmax out, probs
    mlp = [(i, h)] + ([(i,)] if mlp_bias else []) + [(i, h)] + ([(i,)] if mlp_bias else []) + [(h, i)]
    mlp += [(h,)] if mlp_bias else []
    if mt == "phi3":  # fused projections: qkv_proj, o_proj; gate_up_proj, down_proj
        attn, mlp = [(q + 2 * kv, h), (h, q)], [(2 * i, h), (h, i)]
    attn_mm = 2 * (2 * q * h + 2 * kv * h)
    dense = (_aligned(*attn, *mlp, *norms), attn_mm + 2 * 3 * i * h, 2 * (10 * h + 2 * kv + 4 * i))
    fp32_act = 4 * (7 * h + 2 * kv + 4 * i)  # no fp32 upcasts of the norms to save: fewer bytes than 2 × bf16's
    moe_i, shared = cfg.get("moe_intermediate_size") or i, cfg.get("shared_expert_intermediate_size") or 0
    attn_dims = sum(s[0] + s[1] for s in attn if len(s) == 2)
    mlp_dims = sum(s[0] + s[1] for s in mlp if len(s) == 2)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if not 1 <= groups <= max(1, experts):
        raise ConfigError(f"cannot split {experts} experts into {groups} groups")
    if not 1 <= vocab_groups <= v or (vocab_groups > 1 and tied):
        raise ConfigError(
            f"cannot split {name}'s embedding ({'tied, ' if tied else ''}{v} rows) into {vocab_groups} groups"
        )
    blocks = [  # the later vocabulary groups add to their input: backward needs none of it
        BlockShape(vocab_block_name(g), "embed", (hi - lo) * h, 0, 0, keeps_input=g == 0)
        for g, (lo, hi) in enumerate(row_ranges(v, vocab_groups))
    ]
    for k in range(L):
        moe = _moe_layer(cfg, k, attn, attn_mm, h, kv, groups)
        numel, mm, act = moe[0] if moe else dense
        dims = attn_dims + (0 if moe else mlp_dims)  # LoRA on a mixture of experts is refused (adapters)
        top_k = cfg.get("num_experts_per_tok", 2)
        work = top_k * moe_i + shared if moe else i  # routed tokens' intermediates
        if moe and groups > 1:  # the core: attention, router, a shared expert; the groups run the experts
            work = max(shared, h)
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        # backward makes each weight's gradient fresh before adding it into the block's buffer: the largest
        # matrix's (an MLP's; a mixture of experts' fused gate_up_proj; a split layer's core: attention's)
        largest = i * h if not moe else experts * 2 * moe_i * h if groups == 1 else max(q, shared) * h
        blocks.append(
            BlockShape(
                f"layer.{k}", "layer", numel, mm, act, act_bytes_per_token_per_key=per_key, linear_dims=dims,
                work_elems_per_token=work, act_fp32_bytes_per_token=4 * (9 * h + 2 * kv + 4 * top_k * moe_i) if moe and groups == 1 else 0 if moe else fp32_act, bwd_fixed_elems=largest,
            )
        )  # fmt: skip
        for g, ((numel, mm, act), (lo, hi)) in enumerate(zip(moe[1:], group_ranges(experts, groups)) if moe else []):
            blocks.append(
                BlockShape(
                    f"layer.{k}.experts.{g}",
                    "experts",
                    numel,
                    mm,
                    act,
                    keeps_input=False,
                    work_elems_per_token=top_k * moe_i,  # every token's choices, other groups' masked
                    bwd_fixed_elems=(hi - lo) * 2 * moe_i * h,  # its gate_up_proj's gradient, made whole
                )
            )
    if tied:
        blocks.append(BlockShape("head", "head", _aligned((h,)), 2 * v * h, 0, ("embed",)))
    else:  # split: the final norm with the first group (``fuyou.schedule.vocab``)
        for g, (lo, hi) in enumerate(row_ranges(v, vocab_groups)):
            rows = _aligned(*[(h,)] * (g == 0), (hi - lo, h))
            blocks.append(BlockShape(head_block_name(g), "head", rows, 2 * (hi - lo) * h, 0))
    return ModelShape(name, tuple(blocks), h, L, v, experts, groups, vocab_groups, cfg)


def _moe_layer(
    cfg: dict, k: int, attn: Sequence[tuple[int, ...]], attn_mm: int, h: int, kv: int, groups: int = 1
) -> list[tuple[int, int, int]] | None:
    """(elements, matmul FLOPs per token, activation bytes per token) of decoder layer ``k`` of a
    mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE: router, fused experts [E, 2I, h] and [E, h, I],
    Qwen2-MoE's gated shared expert), or None for a dense layer. Expert FLOPs are the routed ones:
    ``num_experts_per_tok`` experts per token. With ``groups`` > 1 the layer's core (everything but
    the routed experts) comes first, then each expert group (``fuyou.models.blocks.split_experts``)
    with its share of the routed FLOPs and activations; else one entry, the whole layer."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    step = cfg.get("decoder_sparse_step", 1) or 1
    if not experts or k in (cfg.get("mlp_only_layers") or []) or (k + 1) % step:
        return None
    i = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    top = cfg.get("num_experts_per_tok", 2)
    core: list[tuple[int, ...]] = [(experts, h)]
    routed: list[tuple[int, ...]] = [(experts, 2 * i, h), (experts, h, i)]
    mm, routed_mm = attn_mm + 2 * experts * h, 2 * top * 3 * i * h
    act, routed_act = 2 * (15 * h + 2 * kv), 2 * 4 * top * i  # 15h: a dense layer's 10h + the router's (measured)
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if shared:
        core += [(shared, h), (shared, h), (h, shared), (1, h)]
        mm += 2 * (3 * shared * h + h)
        act += 2 * 4 * shared
    if groups == 1:
        return [(_aligned(*attn, *core[:1], *routed, *core[1:], (h,), (h,)), mm + routed_mm, act + routed_act)]
    out = [(_aligned(*attn, *core, (h,), (h,)), mm, act)]
    for lo, hi in group_ranges(experts, groups):
        n = hi - lo
        routed_here = top * n / experts  # this group's routed tokens per token, on average
        out.append(
            (
                _aligned((n, 2 * i, h), (n, h, i)),
                int(routed_mm * n // experts),
                # the family's experts module sorts every token's top-k choices, other groups' masked:
                # (2i + 2h) per choice whatever the group, 4i per token routed here, 2i + h (measured)
                int(2 * (top * (2 * i + 2 * h) + 4 * i * routed_here + 2 * i + h)),
            )
        )
    return out


def _gpt2(cfg: dict, name: str) -> ModelShape:
    h, L, v = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    i = cfg.get("n_inner") or 4 * h
    npos = cfg.get("n_positions", 1024)
    layer = _aligned((h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, i), (i,), (i, h), (h,))
    mm = 2 * (4 * h * h + 2 * h * i)
    act = 2 * (11 * h + 4 * i)  # 54·h bytes at i = 4h: measured exactly in bf16 and fp32 (CPU allocation meter)
    blocks = [BlockShape("embed", "embed", _aligned((v, h), (npos, h)), 0, 0)]
    dims = 4 * h + 2 * h + (h + i) + (i + h)  # c_attn, attn c_proj, c_fc, mlp c_proj
    fp32_act = 4 * (11 * h + 4 * i)  # measured exactly (CPU backend's allocation meter, torch 2.13)
    blocks += [
        BlockShape(
            f"layer.{k}", "layer", layer, mm, act, linear_dims=dims, work_elems_per_token=i,
            act_fp32_bytes_per_token=fp32_act, bwd_fixed_elems=i * h,
        )
        for k in range(L)
    ]  # fmt: skip
    blocks.append(BlockShape("head", "head", _aligned((h,), (h,)), 2 * v * h, 0, ("embed",)))
    return ModelShape(name, tuple(blocks), h, L, v)


LLAMA_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe",
)  # fmt: skip
"""``model_type``s of the Llama-like families (dense and mixture-of-experts) the planner shapes."""


def shape_from_config(
    cfg: dict[str, Any], name: str = "model", expert_groups: int = 1, vocab_groups: int = 1
) -> ModelShape:
    """The ModelShape of a Hugging Face config dict (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1/2/3,
    Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-2), its mixture-of-experts layers split into
    ``expert_groups`` expert groups, its embedding into ``vocab_groups`` blocks of vocabulary rows
    (Llama-like families, untied).

    Raises ConfigError for another architecture, a config missing its dimensions, or groups that do
    not split its experts.
    """
    mt = cfg.get("model_type", "")
    archs = cfg.get("architectures") or []
    try:
        if mt == "gpt2" or "GPT2LMHeadModel" in archs:
            return _gpt2(cfg, name)
        if mt in LLAMA_TYPES or any(
            a.startswith(("Llama", "Mistral", "Mixtral", "Qwen", "Phi3", "Gemma")) for a in archs
        ):
            return _llama(cfg, name, expert_groups, vocab_groups)
    except KeyError as e:
        raise ConfigError(
            f"model config {name!r} lacks {e.args[0]!r}; pass a complete Hugging Face config.json"
        ) from None
    raise ConfigError(f"cannot plan for model_type {mt or '?'!r}; supported: {', '.join(LLAMA_TYPES)}, gpt2")


def load_shape(source: str) -> ModelShape:
    """A ModelShape from a model directory, a ``config.json`` path, or a named shape.

    Named shapes: ``gpt3-13b`` (40 layers, hidden 5120, LoHan's testbed), ``gpt3-175b``, ``llama-2-7b``,
    ``llama-2-13b``, ``llama-3-8b``, ``llama-3-70b``, ``llama-3.1-405b``, and the mixtures of experts
    ``mixtral-8x7b``, ``mixtral-8x22b``, ``qwen3-235b-a22b`` (case-insensitive; ``GPT-3-13B`` works).
    Raises ConfigError if ``source`` is neither an existing path nor a known name.
    """
    key = source.lower().replace("_", "-").replace("gpt-3", "gpt3")
    if not os.path.exists(source) and key in NAMED:
        return shape_from_config(NAMED[key], key)
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
    return shape_from_config(cfg, os.path.basename(os.path.dirname(os.path.abspath(path))) or path)
