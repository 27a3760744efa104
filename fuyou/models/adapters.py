"""Per-family adapters: build the Hugging Face model on the meta device, cut it into blocks, and run
one block at a time with real parameters bound to it.

The blocks call the very modules, mask and rotary code of ``transformers``, in the order the
library's own ``forward`` uses, so a streamed step computes what the in-RAM model computes.
Supported: Llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 1/2/3/4 (one block shape: GQA, RoPE, RMSNorm,
gated MLP — Phi-3 with fused qkv and gate-up projections, Gemma with scaled embeddings, Gemma 2's
soft-capped attention and logits, Gemma 3's and 4's rotary table per attention kind; tied or untied
embeddings; sliding-window layers), the
mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE (a decoder layer with its router and every
expert is one block, or, with ``expert_groups`` > 1, a core block followed by expert-group blocks:
``LlamaLike``; their routers' logits are tapped for the balance loss: ``routes``) and GPT-2.
``LlamaLike`` is also the generic adapter of every other family of the standard decoder shape
(``fuyou.models.families``: which families, and how a new one is told apart).
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fuyou.errors import ConfigError
from fuyou.models.activation_rules import EXPERTS, ZERO_EXPERTS, experts_of, top_k_of, zero_experts_of
from fuyou.models.blocks import (
    EXPERTS_PART,
    BlockSpec,
    BufferSpec,
    ParamSpec,
    parse_slice,
    slice_key,
    split_experts,
    split_vocab,
)
from fuyou.models.families import (
    ATTENTION_MASKS,
    GPT2,
    HANDED_ON,
    MASK_OPTIONS,
    architecture_of,
    causal_lm_class,
    embedding_scale,
    handed_from,
    layer_types,
    untrained,
)
from fuyou.models.llama4 import route_experts
from fuyou.models.longcat import GROUP_EXPERTS
from fuyou.models.lora import LoraSettings, base_key, inject, is_lora
from fuyou.schedule.experts import group_ranges
from fuyou.schedule.vocab import row_ranges


@dataclass
class MicroBatchContext:
    """Per-micro-batch values every layer needs (positions, mask, rotary cos/sin), made by the embed block."""

    position_ids: torch.Tensor
    mask: Any = None
    """The attention mask (GPT-2), or one per attention kind (``layer_types``: Llama-like families)."""
    position_embeddings: Any = None
    """The rotary (cos, sin), or one pair per attention kind (Gemma 3)."""
    routes: dict[int, Route] = field(default_factory=dict)
    """Decoder layer → its routed tokens, from the core block of a layer split into expert groups to
    the groups that follow it (``LlamaLike``); dropped after the core's backward."""
    documents: torch.Tensor | None = None
    """Packed documents: each token's document index in its row (``[b, t]``, ``document_ids``), from
    which the embed block makes the block-diagonal masks; None: each row is one document (plain causal
    masks). Only in the seed the embed block starts from (``seed_context``)."""
    input_ids: torch.Tensor | None = None
    """The micro-batch's token ids (``[b, t]``), kept by the first block of an embedding split by
    vocabulary rows for the groups after it, which add their rows' embeddings (``VocabRows``)."""
    handed: dict[int, Any] = field(default_factory=dict)
    """Decoder layer → the value it hands on to later layers (``families.HANDED_ON``: GLM-5's top-k
    indices), kept where a later layer reads it, from its first forward (a recomputation hands on the
    same) until the micro-batch's context is dropped at the end of its backward."""


@dataclass
class Route:
    """What a split mixture-of-experts layer's core hands its expert groups, for one micro-batch:
    the normalised hidden states ``hn`` (``[tokens, hidden]``), each token's ``top_k`` expert
    indices ``idx`` and routing weights ``w`` (``[tokens, top_k]``). In training ``hn`` and ``w``
    are leaves the groups' backward accumulates gradients into; the core's backward carries them on
    (``fuyou.engine.activations``)."""

    hn: torch.Tensor
    idx: torch.Tensor
    w: torch.Tensor


class VocabRows(nn.Module):
    """Rows [lo, hi) of an embedding matrix as a block of their own (``fuyou.schedule.vocab``): the
    embeddings of the tokens whose ids fall in its rows, exact zeros for the others, scaled as the
    family's embedding scales (Gemma: ``scalar_embed_scale``). Summed over the groups, it is the
    unsplit lookup bit for bit; the gradient of its weight is the unsplit gradient's rows, sparse
    (a scatter of its tokens' rows into the preset ``.grad``, as ``nn.Embedding.sparse``)."""

    def __init__(self, whole: nn.Embedding, lo: int, hi: int) -> None:
        super().__init__()
        self.lo, self.hi = lo, hi
        pad = whole.padding_idx
        self.padding_idx = pad - lo if pad is not None and lo <= pad < hi else None
        """The padding row, if in these rows: its gradient stays zero, as ``nn.Embedding``'s."""
        self.scale: float | None = getattr(whole, "scalar_embed_scale", None)
        with torch.device("meta"):
            self.weight = nn.Parameter(torch.empty(hi - lo, whole.embedding_dim, dtype=whole.weight.dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(inside, ids - self.lo, 0)  # tokens of other rows look up row 0, then masked
        rows = nn.functional.embedding(local, self.weight, self.padding_idx, sparse=True)
        out = torch.where(inside.unsqueeze(-1), rows, 0.0)  # their gradient: exactly zero
        if self.scale is not None:  # as the family's scaled embedding: × scale in the weight's dtype
            out = out * torch.tensor(self.scale, device=out.device).to(self.weight.dtype)
        return out


class HeadRows(nn.Module):
    """Rows [lo, hi) of an untied LM head as a block of their own (``fuyou.schedule.vocab``): a
    bias-free ``[hi − lo, hidden]`` weight whose logits are the unsplit head's columns [lo, hi)."""

    def __init__(self, whole: nn.Linear, lo: int, hi: int) -> None:
        super().__init__()
        self.lo, self.hi = lo, hi
        with torch.device("meta"):
            self.weight = nn.Parameter(torch.empty(hi - lo, whole.in_features, dtype=whole.weight.dtype))


class RouteCapture(nn.Module):
    """Stands in for a split layer's experts module inside its core block: keeps the experts' inputs
    (``take``) and returns zeros, so the layer's output is its residual stream plus any shared
    expert, and the expert groups add the routed experts' output after it. With ``identity_from``
    (LongCat-Flash's zero-computation experts, indices from there on: ``activation_rules.ZERO_EXPERTS``)
    it returns what those add instead of zeros: each token's input times its routing weights to them."""

    def __init__(self, identity_from: int | None = None) -> None:
        super().__init__()
        self.seen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.identity_from = identity_from

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        self.seen = (hidden, top_k_index, top_k_weights)
        if self.identity_from is None:
            return torch.zeros_like(hidden)
        zero = top_k_index >= self.identity_from
        weight = torch.where(zero, top_k_weights, torch.zeros_like(top_k_weights)).sum(-1, keepdim=True)
        return (hidden * weight).to(hidden.dtype)

    def take(self) -> Route:
        """The inputs of the last call, as a ``Route``."""
        assert self.seen is not None  # the core block's layer has just run
        route, self.seen = Route(*self.seen), None
        return route


class Adapter:
    """Base adapter: meta-device skeleton, block list, parameter binding. Subclasses run blocks."""

    def __init__(
        self, config: Any, lora: LoraSettings | None = None, expert_groups: int = 1, vocab_groups: int = 1
    ) -> None:
        """The skeleton of ``config``'s model; with ``lora``, ``peft``'s LoRA layers injected and the
        base frozen (``lora_base``): its parameters bind without gradients. ``expert_groups`` > 1 splits
        every mixture-of-experts layer into a core block and that many expert-group blocks
        (``fuyou.models.blocks.split_experts``); ``vocab_groups`` > 1 the embedding into that many
        blocks of vocabulary rows (``fuyou.schedule.vocab``)."""
        self.config = config
        config.use_cache = False
        cls = causal_lm_class(getattr(config, "model_type", "") or "")
        with torch.device("meta"):
            self.model = cls._from_config(config, attn_implementation=attention_kernel(config))
            route_experts(self.model, config)  # Llama 4: its experts on their tokens only (fuyou.models.llama4)
            if lora is not None:
                inject(self.model, lora, untrained(config))
        self.lora_base = lora is not None
        """Whether the streamed base is frozen (LoRA): no gradients for any block's parameters."""
        self.frozen_keys: frozenset[str] = frozenset()
        """Parameters (store keys) bound without gradients (``--freeze``)."""
        self.model.train()
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.modules = self._block_modules()
        for _, mod in self.modules[0][1]:
            if isinstance(mod, nn.Embedding):  # backward scatters the tokens' rows into the preset gradient
                mod.sparse = True  # instead of a dense vocab × hidden zero tensor added whole
        self.dense_experts = any(_runs_every_expert(m) for m in self.model.modules())
        """The family's experts module computes every expert on every token (Llama 4): its FLOPs are all
        the experts', and its layers cannot be split into expert groups."""
        self.blocks = [self._spec(name, mods) for name, mods in self.modules]
        self.slices: dict[int, tuple[int, int]] = {}
        """Expert-group block → the experts [lo, hi) of its layer it owns."""
        self.expert_groups = expert_groups
        if expert_groups > 1:
            self._split_experts(expert_groups)
        self.rows: dict[int, tuple[int, int]] = {}
        """Vocabulary-group block → the embedding rows [lo, hi) it owns (``fuyou.schedule.vocab``)."""
        self.head_rows: dict[int, tuple[int, int]] = {}
        """Head-group block → the LM head rows [lo, hi) it owns (empty: the head is one block)."""
        self.vocab_groups = vocab_groups
        if vocab_groups > 1:
            self._split_vocab(vocab_groups)
        self._routed: list[torch.Tensor] | None = None
        self._tap_routers()
        self._meta = [
            [
                (_owner(mod, pname), p)
                for _, mod in mods
                for pname, p in mod.named_parameters(remove_duplicate=False)
                if not is_lora(pname)
            ]
            for _, mods in self.modules
        ]
        self._param_targets = param_targets(self.model)
        """(module id, name) of the parameters peft's LoRA targets as tensors (``ParamWrapper``: fused experts,
        routers): bound with a version counter of their own (``own_version``)."""
        self._meta_buffers = [
            [(_owner(mod, n), b, base_key(f"{prefix}.{n}")) for prefix, mod in mods for n, b in kept_buffers(mod)]
            for _, mods in self.modules
        ]
        """Per block: the family's checkpointed buffers — (owner, name), meta placeholder, store key — found
        once here, not at every ``bind``."""
        self.held: dict[str, torch.Tensor] = {}
        """The family's persistent buffers on the device, by HF key (``fuyou.engine.family_buffers``): the
        values ``bind`` gives the modules where its ``tensors`` do not."""
        self.reads = handed_from(config)
        """Per decoder layer, the earlier layer whose handed-on value it takes (``families.handed_from``);
        None: the family's layers hand nothing on."""
        self.hand_arg = HANDED_ON[config.model_type][0] if self.reads is not None else ""
        self.sources = frozenset(r for r in self.reads or () if r is not None)
        """The decoder layers whose handed-on value a later layer reads: kept in ``MicroBatchContext.handed``."""

    # -- router tap (mixtures of experts) -----------------------------------------------------
    def _tap_routers(self) -> None:
        """Hook every router module the family names for its ``router_logits`` output (the
        ``OutputRecorder`` that ``transformers`` itself records them with)."""
        recorder = (getattr(type(self.model), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is None:
            return
        cls: type[nn.Module]
        if isinstance(recorder, type):
            cls, index = recorder, 0
        else:
            cls, index = recorder.target_class, recorder.index

        def hook(_mod: nn.Module, _args: Any, out: Any) -> None:
            if self._routed is not None:
                self._routed.append(out[index])

        for mod in self.model.modules():
            if isinstance(mod, cls):
                mod.register_forward_hook(hook)

    @contextmanager
    def routes(self) -> Iterator[list[torch.Tensor]]:
        """Collect the logits (``[tokens, experts]``) of every router call made inside the block, in order."""
        self._routed = []
        try:
            yield self._routed
        finally:
            self._routed = None

    # -- description -------------------------------------------------------------------------
    def _block_modules(self) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
        raise NotImplementedError

    def _split_experts(self, groups: int) -> None:
        raise ConfigError(f"{type(self.model).__name__} has no experts to split into {groups} groups")

    def _split_vocab(self, groups: int) -> None:
        raise ConfigError(f"{type(self.model).__name__}'s embedding cannot be split into {groups} vocabulary groups")

    def additive(self, block: int) -> bool:
        """Whether ``block`` adds to its input a term that does not depend on it (an expert group, a
        vocabulary group after the first: ``delta``), so backward needs neither the input nor its
        forward graph to pass ``dy`` on."""
        return block in self.slices or self.rows.get(block, (0, 0))[0] > 0

    def delta(self, block: int, ctx: MicroBatchContext) -> torch.Tensor:
        """What an ``additive`` block adds to its input (flattened to ``[tokens, hidden]``)."""
        raise NotImplementedError

    def route_of(self, block: int) -> int | None:
        """The decoder layer whose ``Route`` ``block`` makes (the core of a split layer), else None."""
        return None

    def last_of_layer(self, block: int) -> int | None:
        """The decoder layer whose last expert group is ``block`` (after it the layer's ``Route`` is
        no longer needed in forward), else None."""
        return None

    def _spec(self, name: str, mods: list[tuple[str, nn.Module]]) -> BlockSpec:
        params: list[ParamSpec] = []
        buffers: list[BufferSpec] = []
        borrows: tuple[str, ...] = ()
        for prefix, mod in mods:
            for pname, p in mod.named_parameters():
                if is_lora(pname):  # resident and trained apart (fuyou.engine.lora)
                    continue
                key = base_key(f"{prefix}.{pname}")
                if self.tied and name == "head" and key == self.lm_head_key:
                    borrows = ("embed",)
                    continue
                params.append(ParamSpec(key, tuple(p.shape)))
            buffers += [
                BufferSpec(key, tuple(b.shape), keeps_fp32(self.model, key))
                for key, b in ((base_key(f"{prefix}.{n}"), b) for n, b in kept_buffers(mod))
            ]
        flops = 2 * sum(
            p.numel
            for p in params
            if len(p.shape) == 2 and "embed" not in p.key and "wte" not in p.key and "wpe" not in p.key
        )
        # fused experts [E, out, in]: top-k per token, or every expert where the family's module runs them
        # all on every token, unrouted tokens scaled by zero (Llama 4 in transformers)
        routed = experts_of(self.config) if self.dense_experts else top_k_of(self.config)
        flops += 2 * routed * sum(p.numel // p.shape[0] for p in params if len(p.shape) == 3)
        if borrows:
            flops += 2 * self.config.vocab_size * self.hidden
        return BlockSpec(name, tuple(params), borrows, flops, tuple(buffers))

    @property
    def hidden(self) -> int:
        """Model width."""
        return self.config.hidden_size

    lm_head_key = "lm_head.weight"
    embed_key = "model.embed_tokens.weight"

    # -- binding -------------------------------------------------------------------------------
    def bind(self, block: int, tensors: dict[str, torch.Tensor]) -> dict[str, nn.Parameter]:
        """Make the modules of ``block`` use ``tensors`` (by HF key) as parameters.

        The embedding modules are sparse (``nn.Embedding.sparse``): their backward yields a sparse
        gradient of the batch's rows, which autograd adds into a dense ``.grad`` set before backward
        (the engine points every ``.grad`` at its flat gradient buffer); without a preset ``.grad`` the
        embedding's gradient is a sparse tensor.

        Returns the new parameters by the key of the tensor that *owns* them: the tied ``lm_head``
        is returned under the embedding's key, so its gradient lands in the embedding's buffer.
        """
        out = {}
        sliced = (
            {r[0]: p.key for p in self.blocks[block].params if (r := parse_slice(p.key))}
            if block in self.slices
            else {}
        )
        for prefix, mod in self.modules[block][1]:
            for pname, _ in list(mod.named_parameters()):
                if is_lora(pname):
                    continue
                key = base_key(f"{prefix}.{pname}")
                if block in self.slices:  # its rows of the fused tensor (``blocks.split_experts``)
                    key = sliced[key]
                elif block in self.rows and key == self.embed_key:
                    key = slice_key(key, *self.rows[block])
                elif block in self.head_rows and key == self.lm_head_key:
                    key = slice_key(key, *self.head_rows[block])
                if self.tied and key == self.lm_head_key:
                    key = self.embed_key
                owner, attr = _owner(mod, pname)
                t = own_version(tensors[key]) if (id(owner), attr) in self._param_targets else tensors[key]
                param = nn.Parameter(t, requires_grad=not (self.lora_base or key in self.frozen_keys))
                owner._parameters[attr] = param
                out[key] = param
        for (owner, attr), _, key in self._meta_buffers[block]:  # the family's buffers: read-only inputs
            owner._buffers[attr] = tensors[key] if key in tensors else self.held[key]
        return out

    def unbind(self, block: int) -> None:
        """Put the meta placeholders back, so the modules no longer keep the block's device memory alive."""
        for (owner, attr), meta in self._meta[block]:
            owner._parameters[attr] = meta
        for (owner, attr), buf, _ in self._meta_buffers[block]:
            owner._buffers[attr] = buf

    # -- running -------------------------------------------------------------------------------
    def forward(self, block: int, x: torch.Tensor, ctx: MicroBatchContext | None) -> tuple[torch.Tensor, Any]:
        """Run block ``block``: embed takes token ids (and, as ``ctx``, None or a context holding only the
        tokens' ``position_ids``: packed documents) and returns (hidden, context); layers map hidden →
        hidden; the head returns logits."""
        raise NotImplementedError

    def prepare(self, device: torch.device) -> None:
        """Materialise parameter-free buffers (rotary tables) on ``device``."""

    @property
    def first_head(self) -> int:
        """The head's first block (its only one unless split by vocabulary rows: ``head_rows``)."""
        return min(self.head_rows, default=len(self.blocks) - 1)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of the hidden states ``x`` (its module bound with the first head block)."""
        raise NotImplementedError

    def logits(self, block: int, hn: torch.Tensor) -> torch.Tensor:
        """Logits of the normed hidden states ``hn`` by head block ``block`` (its vocabulary rows, or the
        whole head), the weight gradient accumulated in place (``HeadLinear``), soft-capped where the
        config says (``final_logit_softcapping``: Gemma 2)."""
        if block in self.head_rows:
            w = self.modules[block][1][-1][1].weight
            logits = HeadLinear.apply(hn, w)
        else:
            head = self.model.lm_head
            logits = head(hn) if head.bias is not None else HeadLinear.apply(hn, head.weight)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the final hidden states ``h`` (before the final norm) by the whole, unsplit head."""
        return self.logits(len(self.blocks) - 1, self.final_norm(h))


class HeadLinear(torch.autograd.Function):
    """``y = h · Wᵀ`` for the LM head, whose backward adds ``dyᵀ · h`` straight into ``W.grad`` when a
    dense gradient is already attached (the engine presets every ``.grad`` to its flat buffer): one
    ``addmm_`` instead of a fresh vocab × hidden gradient tensor plus an add — the step's largest
    temporary (1 GB for a 128 k × 4096 head in bf16) and, on the CPU backend, 0.3 s → 0.1 s per
    micro-batch for a 128 k × 2048 head. Without a preset ``.grad`` it returns the gradient as usual.
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        ctx.weight = weight
        return torch.nn.functional.linear(h, weight)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        (h,) = ctx.saved_tensors
        w = ctx.weight
        dh = dy @ w if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dh, None
        dy2, h2 = dy.reshape(-1, dy.shape[-1]), h.reshape(-1, h.shape[-1])
        g = w.grad
        if g is not None and not g.is_sparse and g.dtype == dy.dtype and g.is_contiguous():
            g.addmm_(dy2.t(), h2)
            return dh, None
        return dh, dy2.t() @ h2


def _runs_every_expert(mod: nn.Module) -> bool:
    """Whether ``mod`` is an experts module (its class name ends in ``Experts``) whose ``forward`` takes
    the hidden states alone, not the routing (Llama 4's: every expert on every token)."""
    if not type(mod).__name__.endswith("Experts"):
        return False
    return len(inspect.signature(type(mod).forward).parameters) == 2


def _experts_path(layer: nn.Module) -> str:
    """Where a decoder layer keeps its experts module, relative to the layer: ``mlp.experts`` (Mixtral,
    Qwen-MoE, …), ``feed_forward.experts`` (Llama 4) or ``experts`` beside a dense MLP (Gemma 4)."""
    for owner in ("mlp", "feed_forward"):
        if getattr(getattr(layer, owner, None), "experts", None) is not None:
            return f"{owner}.experts"
    return "experts"


def _experts_owner(layer: nn.Module) -> nn.Module:
    """The module holding a decoder layer's ``experts`` attribute (``_experts_path``)."""
    return _owner(layer, _experts_path(layer))[0]


def param_targets(model: nn.Module) -> set[tuple[int, str]]:
    """(id of the module, parameter name) of every parameter ``peft`` wraps as a tensor (its
    ``ParamWrapper``, what ``all-linear`` makes of a mixture of experts' fused expert tensors)."""
    wrappers: list[Any] = [mod for mod in model.modules() if type(mod).__name__ == "ParamWrapper"]
    return {(id(w.get_base_layer()), str(w.parameter_name)) for w in wrappers}


def own_version(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a tensor with a version counter of its own. peft's ``ParamWrapper`` re-sets the
    parameter it wraps in place each forward (``torch.nn.utils.parametrize``); bound as a view of the
    block's flat vector, that would bump the counter every other weight of the block shares, and
    backward would refuse their saved values as modified. The memory is only read."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


def kept_buffers(mod: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``mod``'s persistent buffers (in its state dict, hence in the family's checkpoints) other than
    rotary tables: values the family keeps but does not train (the aux-loss-free router bias
    ``e_score_correction_bias`` of DeepSeek-V3 and GLM-4.5), stored apart from the parameters
    (``fuyou.models.blocks.BufferSpec``) and bound at every ``Adapter.bind``."""
    out = []
    for name, buf in mod.named_buffers():
        owner, attr = _owner(mod, name)
        if attr not in owner._non_persistent_buffers_set and "rotary_emb" not in name:
            out.append((name, buf))
    return out


def keeps_fp32(model: nn.Module, key: str) -> bool:
    """Whether ``transformers`` keeps the tensor ``key`` of ``model`` in fp32 when it loads the model in
    bf16: its name contains an entry of the model's ``_keep_in_fp32_modules_strict`` (the library's own
    substring match; the non-strict list applies to fp16 only, which Fuyou does not compute in).
    DeepSeek-V3 and GLM-4.5 name their router biases: bf16 would round them by up to 2⁻⁹ of their
    size, enough to change which experts a token goes to."""
    return any(n in key for n in getattr(model, "_keep_in_fp32_modules_strict", None) or ())


def _owner(mod: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, attr = dotted.split(".")
    for p in path:
        mod = getattr(mod, p)
    return mod, attr


def _positions(x: torch.Tensor, seed: MicroBatchContext | None) -> torch.Tensor:
    """The positions of a micro-batch's ``[b, t]`` tokens: the caller's (``seed.position_ids``: packed
    documents, each counting from 0), else 0…t−1."""
    if seed is not None:
        return seed.position_ids
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's document index in its row (``[b, t]``): a new document starts wherever a position
    does not follow the previous one by 1 (``transformers``' own rule for packed sequences)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def seed_context(position_ids: torch.Tensor, device: torch.device) -> MicroBatchContext | None:
    """What a micro-batch's embed block starts from, given its tokens' ``position_ids`` (``[b, t]``):
    None where every row counts 0…t−1 (no packed documents: plain causal masks, as without
    ``position_ids``), else a context holding them (on ``device``) and, where a row holds more than one
    document, their ``document_ids``. Host tensors are inspected on the host; a tensor already on the
    device is not inspected (that would wait for the device): it is taken as packed.

    Why: given ``position_ids`` and no attention mask, ``transformers``' mask functions look for packed
    documents themselves, and that test reads a value back from the device (a sync per micro-batch
    and mask kind). Fuyou hands them no ``position_ids``: the documents, if any, as a mask function."""
    if position_ids.device.type != "cpu":
        return MicroBatchContext(position_ids.to(device), documents=document_ids(position_ids))
    docs = document_ids(position_ids)
    if not bool(docs[:, -1].any()):  # one document per row
        plain = torch.arange(position_ids.shape[1], dtype=position_ids.dtype)
        if bool((position_ids == plain).all()):
            return None
        return MicroBatchContext(position_ids.to(device))
    return MicroBatchContext(position_ids.to(device), documents=docs.to(device))


def _make_mask(make: Callable, config: Any, embeds: torch.Tensor, documents: torch.Tensor | None) -> Any:
    """A ``transformers`` mask function's mask for ``embeds`` (no attention mask, no cache): never given
    ``position_ids`` (their packed-sequence test syncs with the device: ``seed_context``); packed
    ``documents`` as a mask function keeping each token's attention within its document. The cache goes
    by position: ``past_key_values`` before transformers 5.24, ``cache`` since."""
    extra = {"and_mask_function": _same_document(documents)} if documents is not None else {}
    return make(config, embeds, None, None, **extra)


def _same_document(documents: torch.Tensor) -> Callable:
    """Mask function: query and key token are in the same document (``documents``: ``document_ids``)."""

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return documents[batch_idx, q_idx] == documents[batch_idx, kv_idx]

    return inner


def _causal_mask(config: Any, embeds: torch.Tensor, documents: torch.Tensor | None) -> Any:
    from transformers.masking_utils import create_causal_mask

    return _make_mask(create_causal_mask, config, embeds, documents)


def attention_kernel(config: Any) -> str:
    """``sdpa``, or ``eager`` where the attention scores are soft-capped (``attn_logit_softcapping``:
    Gemma 2) or the family's attention has no ``sdpa`` path in ``transformers`` (GPT-OSS's attention
    sinks): ``transformers`` trains those with its eager attention. Eager attention keeps each layer's
    ``heads × T × T`` probabilities for backward (the activation probe measures them:
    ``fuyou.models.activation_probe``)."""
    if getattr(config, "attn_logit_softcapping", None):
        return "eager"
    cls = causal_lm_class(getattr(config, "model_type", "") or "")
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


def _masks(config: Any, embeds: torch.Tensor, documents: torch.Tensor | None, types: set[str]) -> dict[str, Any]:
    """The attention mask of each kind in ``types``, made by ``transformers``' own mask functions
    (``documents``: packed documents, ``MicroBatchContext.documents``; ``families.ATTENTION_MASKS``, with
    ``families.MASK_OPTIONS``)."""
    from transformers import masking_utils

    made = {
        t: functools.partial(getattr(masking_utils, f), **MASK_OPTIONS.get(t, {}))
        for t in types
        if (f := ATTENTION_MASKS[t])
    }
    masks = {t: _make_mask(make, config, embeds, documents) for t, make in made.items()}
    if "linear_attention" in types:  # a recurrence over the whole row: no mask without padding
        if documents is not None:
            raise ConfigError(
                "packed documents (position_ids restarting within a row) cannot be kept apart by this model's "
                "linear-attention layers, whose state runs through the row; pack one document per row"
            )
        masks["linear_attention"] = None
    return masks


class LlamaLike(Adapter):
    """Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1/2/3/4 and the mixtures of experts: ``model.embed_tokens``,
    ``model.layers``, ``model.norm``, ``lm_head``.

    Sliding-window attention is honoured per layer (``layer_types``), with the rotary table of the
    layer's kind where the family has one per kind (Gemma 3)."""

    def _block_modules(self) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
        m = self.model.model
        blocks = [("embed", [("model.embed_tokens", m.embed_tokens)])]
        blocks += [(f"layer.{i}", [(f"model.layers.{i}", layer)]) for i, layer in enumerate(m.layers)]
        blocks.append(("head", [("model.norm", m.norm), ("lm_head", self.model.lm_head)]))
        self.layer_of = [-1] + list(range(len(m.layers))) + [-1]
        """Block → its decoder layer (−1: embed, head)."""
        return blocks

    def _split_experts(self, groups: int) -> None:
        """Cut every mixture-of-experts layer into its core block (the layer, its experts module
        replaced by a ``RouteCapture``) and ``groups`` blocks of experts, each running an instance of
        the family's own experts module sized to its group."""
        experts = experts_of(self.config)
        if not experts:
            raise ConfigError(f"this {self.config.model_type} model has no experts to split into {groups} groups")
        if self.dense_experts:
            raise ConfigError(
                f"this {self.config.model_type} model's experts run every expert on every token (transformers' "
                f"implementation): its layers cannot be split into {groups} expert groups; raise --gpu-memory"
            )
        if any(_experts_path(layer) == "experts" for layer in self.model.model.layers if hasattr(layer, "experts")):
            raise ConfigError(
                f"this {self.config.model_type} model normalises its experts' output beside its MLP's before the "
                f"residual sum (Gemma 4), so a layer is not the sum of {groups} expert groups; raise --gpu-memory"
            )
        if any(type(m).__name__ == "ParamWrapper" and ".experts" in n for n, m in self.model.named_modules()):
            raise ConfigError(
                f"LoRA on the experts of this {self.config.model_type} model needs each layer's experts in one block, "
                f"not {groups} expert groups; raise --gpu-memory, or leave the experts out of --lora-targets"
            )
        if not 1 <= groups <= experts:
            raise ConfigError(
                f"cannot split the {experts} experts of this {self.config.model_type} model into {groups} groups"
            )
        zero = zero_experts_of(self.config)
        self.blocks = list(split_experts(tuple(self.blocks), groups, experts, top_k_of(self.config), zero))
        layers, ranges = self.model.model.layers, group_ranges(experts, groups)
        modules, layer_of = [], []
        for spec in self.blocks:
            if EXPERTS_PART not in spec.name:
                b = [name for name, _ in self.modules].index(spec.name)
                modules.append(self.modules[b])
                layer_of.append(self.layer_of[b])
                continue
            name, g = spec.name.split(EXPERTS_PART)
            i = int(name.removeprefix("layer."))
            owner: Any = _experts_owner(layers[i])
            if not isinstance(owner.experts, RouteCapture):
                cls = type(owner.experts)
                self._experts_cls = GROUP_EXPERTS.get(cls.__name__, cls)
                owner.experts = RouteCapture(experts if zero else None)
            lo, hi = ranges[int(g)]
            self.slices[len(modules)] = (lo, hi)
            path = _experts_path(layers[i])
            last = int(g) == groups - 1  # it holds the rows sized for the zero-computation experts too
            modules.append((spec.name, [(f"model.layers.{i}.{path}", self._experts_module(hi - lo, zero * last))]))
            layer_of.append(i)
        self.modules, self.layer_of = modules, layer_of

    def _split_vocab(self, groups: int) -> None:
        """Cut the embedding into ``groups`` blocks of vocabulary rows, each running a ``VocabRows``, and
        the LM head into as many, each a ``HeadRows`` (``fuyou.schedule.vocab``). Raises ConfigError for
        tied embeddings (the head borrows the whole matrix) or a head that is not a bias-free linear
        layer (LoRA on the head)."""
        vocab = self.config.vocab_size
        if self.tied:
            raise ConfigError(
                "an embedding tied to the LM head (tie_word_embeddings) cannot be split into vocabulary groups: "
                "the head borrows the whole matrix; use vocab_groups 1"
            )
        if not 1 <= groups <= vocab:
            raise ConfigError(f"cannot split a vocabulary of {vocab} rows into {groups} groups")
        head = self.model.lm_head
        if type(head) is not nn.Linear or head.bias is not None:
            raise ConfigError(
                "this LM head (a bias, or LoRA on lm_head) cannot be split into vocabulary groups; "
                "use vocab_groups 1 or leave lm_head out of the LoRA targets"
            )
        whole = self.model.model.embed_tokens
        self.blocks = list(split_vocab(tuple(self.blocks), groups, self.embed_key, vocab, self.lm_head_key))
        shift = groups - 1
        ranges = row_ranges(vocab, groups)
        parts: list[tuple[str, list[tuple[str, nn.Module]]]] = []
        for g, (lo, hi) in enumerate(ranges):
            self.rows[g] = (lo, hi)
            parts.append((self.blocks[g].name, [("model.embed_tokens", VocabRows(whole, lo, hi))]))
        heads: list[tuple[str, list[tuple[str, nn.Module]]]] = []
        first = len(self.modules) - 1 + shift
        for g, (lo, hi) in enumerate(ranges):
            self.head_rows[first + g] = (lo, hi)
            norm = [("model.norm", self.model.model.norm)] if g == 0 else []
            heads.append((self.blocks[first + g].name, [*norm, ("lm_head", HeadRows(head, lo, hi))]))
        self.modules = parts + self.modules[1:-1] + heads
        self.layer_of = [-1] * shift + self.layer_of + [-1] * shift
        self.slices = {b + shift: r for b, r in self.slices.items()}

    def _experts_module(self, n: int, zero: int = 0) -> nn.Module:
        """The family's experts module for ``n`` experts (or the one its groups run instead:
        ``longcat.GROUP_EXPERTS``), on the meta device, its tensors sized for ``zero`` zero-computation
        experts more (``activation_rules.ZERO_EXPERTS``), which no group computes."""
        sub = copy.copy(self.config)
        for attr in EXPERTS:
            if getattr(sub, attr, None):
                setattr(sub, attr, n)
        for attr in ZERO_EXPERTS:
            if getattr(sub, attr, None):
                setattr(sub, attr, zero)
        with torch.device("meta"):
            mod = self._experts_cls(sub).train()
        # the kernels (``transformers.integrations.moe``: eager, batched, grouped) skip a token routed
        # to index n (another group's expert) when told, as they are for expert parallelism
        mod._is_expert_parallel = True
        return mod

    def route_of(self, block: int) -> int | None:
        i = self.layer_of[block]
        return i if i >= 0 and block not in self.slices and isinstance(self._mlp(i), RouteCapture) else None

    def last_of_layer(self, block: int) -> int | None:
        if block not in self.slices or (block + 1 in self.slices and self.layer_of[block + 1] == self.layer_of[block]):
            return None
        return self.layer_of[block]

    def _mlp(self, i: int) -> Any:
        return getattr(_experts_owner(self.model.model.layers[i]), "experts", None)

    def delta(self, block: int, ctx: MicroBatchContext) -> torch.Tensor:
        """A later vocabulary group's embeddings of its tokens (``VocabRows`` over ``ctx.input_ids``),
        or an expert group's share of its layer's routed experts: the family's experts module over the
        ``Route`` the layer's core left in ``ctx``, tokens routed to other groups' experts mapped to
        the module's skip index (its expert count)."""
        if block in self.rows:
            assert ctx.input_ids is not None  # kept by the first vocabulary group
            return self._scaled(self.modules[block][1][0][1](ctx.input_ids))
        lo, hi = self.slices[block]
        route = ctx.routes[self.layer_of[block]]
        local = route.idx - lo
        local = torch.where((local >= 0) & (local < hi - lo), local, hi - lo)
        return self.modules[block][1][0][1](route.hn, local, route.w)

    def prepare(self, device: torch.device) -> None:
        """Rebuild the computed buffers, meta in the skeleton, on ``device``: the rotary embedding and
        a scaled embedding's scale (Gemma: √hidden). Raises ConfigError naming any other buffer."""
        m = self.model.model
        self.rotary = type(m.rotary_emb)(config=self.config).to(device)
        self.layer_types = layer_types(self.config)
        self.embed_scale = embedding_scale(self.config)
        self.per_kind = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.kv_table = "shared_kv_states" in inspect.signature(type(m.layers[0]).forward).parameters
        """The family's layers take a table they leave their keys and values in for later layers (Gemma 4,
        ``num_kv_shared_layers``: refused by ``families.gemma4_departures`` unless 0, so nothing reads it)."""
        for mod in m.modules():
            if hasattr(mod, "scalar_embed_scale"):
                mod.embed_scale = torch.tensor(mod.scalar_embed_scale, device=device)
        bound = {n for n, _ in kept_buffers(m)}  # each block binds its own (``bind``)
        left = [n for n, b in m.named_buffers() if b.is_meta and not n.startswith("rotary_emb.") and n not in bound]
        if left:
            raise ConfigError(
                f"this {getattr(self.config, 'model_type', '?')} model has buffers Fuyou cannot rebuild ({left[:3]}); "
                "it is not a supported variant of its family"
            )

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.model.norm(x)

    def _scaled(self, embeds: torch.Tensor) -> torch.Tensor:
        """``embeds`` times the factor the family's base model applies outside its embedding module
        (``families.embedding_scale``: AFMoE's muP input scaling), as it applies it."""
        return embeds if self.embed_scale is None else embeds * self.embed_scale

    def _rotary(self, embeds: torch.Tensor, pos: torch.Tensor) -> Any:
        """The rotary (cos, sin) for ``pos``: one pair, or one per attention kind (Gemma 3)."""
        if self.per_kind:
            return {t: self.rotary(embeds, pos, t) for t in set(self.layer_types)}
        return self.rotary(embeds, position_ids=pos)

    def forward(self, block: int, x: torch.Tensor, ctx: MicroBatchContext | None) -> tuple[torch.Tensor, Any]:
        m = self.model.model
        if block == 0:
            embeds = self._scaled(self.modules[0][1][0][1](x))  # the embedding, or its first vocabulary group
            pos = _positions(x, ctx)
            docs = ctx.documents if ctx is not None else None
            masks = _masks(self.config, embeds, docs, set(self.layer_types))
            ctx = MicroBatchContext(pos, masks, self._rotary(embeds, pos))
            if self.rows:  # the later vocabulary groups look up the same tokens
                ctx.input_ids = x
            return embeds, ctx
        if block == len(self.blocks) - 1:
            return self.lm_head(x), ctx
        assert ctx is not None  # block 0 made it
        if self.additive(block):
            return x + self.delta(block, ctx).view(x.shape).to(x.dtype), ctx
        i = self.layer_of[block]
        kind = self.layer_types[i]
        rope = ctx.position_embeddings[kind] if self.per_kind else ctx.position_embeddings
        table: dict[str, Any] = {"shared_kv_states": {}} if self.kv_table else {}
        if self.reads is not None:
            src = self.reads[i]
            table[self.hand_arg] = ctx.handed[src] if src is not None else None
        y = m.layers[i](
            x, attention_mask=ctx.mask[kind], position_embeddings=rope, position_ids=ctx.position_ids, **table
        )
        if self.reads is not None:  # (hidden states, what the layer hands on)
            y, handed = y
            if i in self.sources:
                ctx.handed.setdefault(i, handed)
        capture = self._mlp(i)
        if isinstance(capture, RouteCapture):
            ctx.routes[i] = capture.take()
        return y, ctx


class GPT2Adapter(Adapter):
    """GPT-2: ``transformer.wte``/``wpe``, ``transformer.h``, ``transformer.ln_f``, tied ``lm_head``."""

    lm_head_key = "lm_head.weight"
    embed_key = "transformer.wte.weight"

    @property
    def hidden(self) -> int:
        return self.config.n_embd

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.transformer.ln_f(x)

    def _block_modules(self) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
        t = self.model.transformer
        blocks = [("embed", [("transformer.wte", t.wte), ("transformer.wpe", t.wpe)])]
        blocks += [(f"layer.{i}", [(f"transformer.h.{i}", b)]) for i, b in enumerate(t.h)]
        blocks.append(("head", [("transformer.ln_f", t.ln_f), ("lm_head", self.model.lm_head)]))
        return blocks

    def forward(self, block: int, x: torch.Tensor, ctx: MicroBatchContext | None) -> tuple[torch.Tensor, Any]:
        t = self.model.transformer
        if block == 0:
            pos = _positions(x, ctx)
            embeds = t.wte(x)
            hidden = embeds + t.wpe(pos)
            docs = ctx.documents if ctx is not None else None
            ctx = MicroBatchContext(pos, _causal_mask(self.config, embeds, docs))
            return t.drop(hidden), ctx
        if block == len(self.blocks) - 1:
            return self.lm_head(x), ctx
        assert ctx is not None  # block 0 made it
        return t.h[block - 1](x, None, ctx.mask, None, position_ids=ctx.position_ids), ctx


def make_adapter(
    config: Any, lora: LoraSettings | None = None, expert_groups: int = 1, vocab_groups: int = 1
) -> Adapter:
    """The adapter for ``config``'s architecture (with ``lora``: LoRA layers injected, the base frozen;
    ``expert_groups`` > 1: a mixture of experts' layers split into that many expert groups;
    ``vocab_groups`` > 1: the embedding split into that many blocks of vocabulary rows); raises
    ConfigError for unsupported ones, or groups that do not divide the experts (or rows) into non-empty
    sets, or a tied embedding to split."""
    arch = architecture_of(config)
    if arch in GPT2:
        return GPT2Adapter(config, lora, expert_groups, vocab_groups)
    return LlamaLike(config, lora, expert_groups, vocab_groups)
