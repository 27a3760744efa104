"""A model as a list of blocks — embed, decoder layers, head — described without any weights.

Each block owns a set of parameters (its extent in the store, keyed by their Hugging Face
state-dict names) and may *borrow* another block's parameters: with tied embeddings the head uses
the embedding matrix, whose gradient then accumulates from both blocks before one Adam update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fuyou.schedule.experts import EXPERTS_PART, group_ranges
from fuyou.schedule.vocab import head_block_name, row_ranges, vocab_block_name
from fuyou.storage.extents import ExtentSpec, TensorSpec


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: Hugging Face state-dict key and shape."""

    key: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class BufferSpec:
    """A persistent buffer the family keeps in its checkpoint and never trains (DeepSeek-V3's and
    GLM-4.5's router ``e_score_correction_bias``): stored once per block apart from the parameters'
    flat vectors (``ModelLayout.k``), held on the device through the run, exported as it came."""

    key: str
    shape: tuple[int, ...]
    fp32: bool = False
    """The family keeps it in fp32 whatever the compute dtype (its ``_keep_in_fp32_modules_strict``, as
    ``transformers`` loads it); else it is held in the compute dtype."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def dtype(self, compute: torch.dtype) -> torch.dtype:
        """The dtype it is stored, held and bound in when the model computes in ``compute``."""
        return torch.float32 if self.fp32 else compute


@dataclass(frozen=True)
class BlockSpec:
    """A unit of streaming: its parameters, the blocks it borrows from, its forward FLOPs/token."""

    name: str
    params: tuple[ParamSpec, ...]
    borrows: tuple[str, ...] = ()
    flops_per_token: int = 0
    """Forward FLOPs per token (2 per multiply-add of the matmuls, attention excluded)."""
    buffers: tuple[BufferSpec, ...] = ()
    """The family's persistent buffers its modules read (``BufferSpec``); not parameters."""

    @property
    def numel(self) -> int:
        """Parameters owned by this block."""
        return sum(p.numel for p in self.params)

    def extent(self, prefix: str, dtype: torch.dtype) -> ExtentSpec:
        """The store extent ``prefix + name`` holding this block's parameters in ``dtype``."""
        return ExtentSpec(prefix + self.name, tuple(TensorSpec(p.key, p.shape, dtype) for p in self.params))


def slice_key(key: str, lo: int, hi: int) -> str:
    """The store key of rows ``lo…hi−1`` of dim 0 of ``key``: experts of a fused expert tensor, or
    vocabulary rows of an embedding matrix."""
    return f"{key}[{lo}:{hi}]"


def parse_slice(key: str) -> tuple[str, int, int] | None:
    """``(HF key, lo, hi)`` of a ``slice_key``, or None for a whole tensor's key."""
    if not key.endswith("]") or "[" not in key:
        return None
    base, rows = key[:-1].rsplit("[", 1)
    lo, hi = rows.split(":")
    return base, int(lo), int(hi)


def split_experts(
    blocks: tuple[BlockSpec, ...], groups: int, experts: int, top_k: int, extra_rows: int = 0
) -> tuple[BlockSpec, ...]:
    """``blocks`` with every mixture-of-experts layer cut into a core block (attention, router, shared
    expert, norms; same name) followed by ``groups`` expert-group blocks ``<layer>.experts.<g>``, each
    owning experts [lo, hi) of the layer's fused expert tensors (``[experts, …]``, keys ``slice_key``).
    A fused tensor with ``extra_rows`` more rows (LongCat-Flash's ``gate_up_proj``, sized for its
    zero-computation experts too, which never read it) gives those to the last group. Forward FLOPs move
    with the experts: a group's are its share of the routed ones (``top_k`` experts per token, spread over
    all ``experts``). ``groups`` == 1: ``blocks`` unchanged.

    Raises ValueError if ``groups`` is not in 1…``experts``.
    """
    if groups == 1:
        return blocks
    if not 1 <= groups <= experts:
        raise ValueError(f"cannot split {experts} experts into {groups} groups")
    out: list[BlockSpec] = []
    for blk in blocks:
        # the fused expert tensors [experts, …]: weights, and per-expert biases (GPT-OSS) with them
        rows = (experts, experts + extra_rows)
        fused = [p for p in blk.params if len(p.shape) >= 2 and p.shape[0] in rows and ".experts." in p.key]
        if not fused:
            out.append(blk)
            continue
        routed = 2 * top_k * sum(p.numel // p.shape[0] for p in fused if len(p.shape) == 3)
        core = tuple(p for p in blk.params if p not in fused)
        out.append(BlockSpec(blk.name, core, blk.borrows, blk.flops_per_token - routed, blk.buffers))
        ranges = group_ranges(experts, groups)
        for g, (lo, hi) in enumerate(ranges):
            ends = {p.key: p.shape[0] if g == len(ranges) - 1 else hi for p in fused}
            params = tuple(
                ParamSpec(slice_key(p.key, lo, ends[p.key]), (ends[p.key] - lo, *p.shape[1:])) for p in fused
            )
            flops = routed * hi // experts - routed * lo // experts  # the groups' sum is the layer's
            out.append(BlockSpec(f"{blk.name}{EXPERTS_PART}{g}", params, (), flops))
    return tuple(out)


def split_vocab(
    blocks: tuple[BlockSpec, ...], groups: int, embed_key: str, vocab: int, head_key: str | None = None
) -> tuple[BlockSpec, ...]:
    """``blocks`` with the embedding (block 0, parameter ``embed_key`` of ``[vocab, hidden]``) cut by
    vocabulary rows into ``groups`` blocks (``fuyou.schedule.vocab``): ``embed`` owning rows [0, hi)
    and any other parameter of the embedding block, then ``embed.vocab.<g>`` each owning its rows
    (keys ``slice_key``). With ``head_key`` (an untied LM head, ``[vocab, hidden]`` in the last block)
    the head is cut the same way: ``head`` owning rows [0, hi) and the head's other parameters (the
    final norm), then ``head.vocab.<g>``; each group's forward FLOPs are its rows' share.
    ``groups`` == 1: ``blocks`` unchanged.

    Raises ValueError if ``groups`` is not in 1…``vocab`` or the embedding block has no ``embed_key``
    (the head no ``head_key``).
    """
    if groups == 1:
        return blocks
    if not 1 <= groups <= vocab:
        raise ValueError(f"cannot split a vocabulary of {vocab} rows into {groups} groups")
    body = blocks[1:-1] if head_key is not None else blocks[1:]
    out = _rows(blocks[0], groups, embed_key, vocab, vocab_block_name, flops=False)
    out += list(body)
    if head_key is not None:
        out += _rows(blocks[-1], groups, head_key, vocab, head_block_name, flops=True)
    return tuple(out)


def _rows(
    blk: BlockSpec, groups: int, key: str, vocab: int, name: Callable[[int], str], flops: bool
) -> list[BlockSpec]:
    """``blk`` cut into ``groups`` blocks of rows of its ``key`` matrix (the first keeps the block's
    other parameters and what it borrows); with ``flops`` each group's matmul FLOPs are its rows'."""
    matrix = [p for p in blk.params if p.key == key]
    if not matrix:
        raise ValueError(f"the {blk.name} block holds no {key!r} to split")
    hidden = matrix[0].shape[1:]
    out = []
    for g, (lo, hi) in enumerate(row_ranges(vocab, groups)):
        rows = ParamSpec(slice_key(key, lo, hi), (hi - lo, *hidden))
        others = tuple(p for p in blk.params if p.key != key) if g == 0 else ()
        f = 2 * rows.numel if flops else 0
        # the whole tensors first: an export meets them before the rows it joins with the next groups'
        out.append(BlockSpec(name(g), (*others, rows), blk.borrows if g == 0 else (), f, blk.buffers if g == 0 else ()))
    return out
