"""A model as a list of blocks — embed, decoder layers, head — described without any weights.

Each block owns a set of parameters (its extent in the store, keyed by their Hugging Face
state-dict names) and may *borrow* another block's parameters: with tied embeddings the head uses
the embedding matrix, whose gradient then accumulates from both blocks before one Adam update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
class BlockSpec:
    """A unit of streaming: its parameters, the blocks it borrows from, its forward FLOPs/token."""

    name: str
    params: tuple[ParamSpec, ...]
    borrows: tuple[str, ...] = ()
    flops_per_token: int = 0
    """Forward FLOPs per token (2 per multiply-add of the matmuls, attention excluded)."""

    @property
    def numel(self) -> int:
        """Parameters owned by this block."""
        return sum(p.numel for p in self.params)

    def extent(self, prefix: str, dtype: torch.dtype) -> ExtentSpec:
        """The store extent ``prefix + name`` holding this block's parameters in ``dtype``."""
        return ExtentSpec(prefix + self.name, tuple(TensorSpec(p.key, p.shape, dtype) for p in self.params))
