"""Per-layer optimizer-state layout: one flat buffer per layer and quantity, one extent per layer.

A layer's parameters (q, k, v, o, MLP, norms, ...) are laid end to end in one flat buffer in a
fixed order; every parameter starts at a multiple of ``ALIGN_ELEMS`` elements, so its offset is
64-byte aligned in fp32 (128 B) and in bf16 (64 B) alike, and the same element offsets serve the
fp32 master, m, v, the gradient and the bf16 weights. Gaps are padding that stays zero: with zero
gradient, a zero master, m and v stay exactly zero under AdamW (the engine must zero the padding of
gradient buffers once; device→host copies write only the parameters' ranges).

The optimizer state of a layer lives in one extent of ``nbytes`` bytes: master (fp32), then m,
then v (fp32, or bf16 for the small-state option), each section starting 64-byte aligned. That
matches the store's grouping of a layer's tensors into one contiguous, 64-byte-aligned extent: the
engine reads the extent into a host buffer and ``views`` carves the three flat tensors out of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fuyou.errors import ConfigError
from fuyou.optim.buffers import OptimBufferError

ALIGN_BYTES: int = 64
"""Byte alignment of every parameter slot and every state section."""
ALIGN_ELEMS: int = 32
"""Element alignment of parameter slots: 64 B in bf16, 128 B in fp32."""
STATE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Names accepted for the m/v storage dtype."""


def _align(n: int, to: int) -> int:
    """Round ``n`` up to a multiple of ``to``."""
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lies in its layer's flat buffers (in elements, not bytes)."""

    name: str
    """Parameter name within the layer (e.g. ``self_attn.q_proj.weight``)."""
    shape: tuple[int, ...]
    """The parameter's shape."""
    offset: int
    """First element in the flat buffer; a multiple of ``ALIGN_ELEMS``."""

    @property
    def numel(self) -> int:
        """Number of elements of the parameter."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class LayerStateLayout:
    """One layer's flat parameter order and optimizer-state extent; build with ``layer_layout``."""

    slots: tuple[ParamSlot, ...]
    """Parameters in flat order, non-overlapping, aligned."""
    numel: int
    """Flat length in elements, padding included; a multiple of ``ALIGN_ELEMS``."""
    state_dtype: str = "fp32"
    """Storage dtype of m and v: ``"fp32"`` or ``"bf16"``; the master is always fp32."""

    def __post_init__(self) -> None:
        if self.state_dtype not in STATE_DTYPES:
            raise ConfigError(
                f"state_dtype={self.state_dtype!r}; expected one of {sorted(STATE_DTYPES)}"
            )
        end = 0
        for s in self.slots:
            if s.offset % ALIGN_ELEMS or s.offset < end:
                raise ConfigError(f"slot {s.name!r} at element {s.offset} overlaps or is unaligned")
            end = s.offset + s.numel
        if self.numel % ALIGN_ELEMS or self.numel < end:
            raise ConfigError(
                f"numel={self.numel} must cover the slots and be a multiple of {ALIGN_ELEMS}"
            )

    @property
    def state_torch_dtype(self) -> torch.dtype:
        """m and v dtype as a torch dtype."""
        return STATE_DTYPES[self.state_dtype]

    @property
    def master_bytes(self) -> int:
        """Bytes of the fp32 master section."""
        return self.numel * 4

    @property
    def moment_bytes(self) -> int:
        """Bytes of the m section (and of the v section)."""
        return self.numel * self.state_torch_dtype.itemsize

    @property
    def m_offset(self) -> int:
        """Byte offset of m in the extent (master is at 0)."""
        return self.master_bytes

    @property
    def v_offset(self) -> int:
        """Byte offset of v in the extent."""
        return self.master_bytes + self.moment_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole state extent: master + m + v."""
        return self.master_bytes + 2 * self.moment_bytes

    @property
    def bf16_bytes(self) -> int:
        """Bytes of one flat bf16 buffer (gradient or weight copy) of this layer."""
        return self.numel * 2

    def views(self, extent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Carve (master, m, v) flat tensors out of a uint8 extent of ``nbytes`` bytes, no copy.

        Raises:
            OptimBufferError: if ``extent`` is not a contiguous CPU uint8 tensor of ``nbytes``
                bytes, or its start is not 64-byte aligned.
        """
        if extent.dtype != torch.uint8 or extent.dim() != 1 or not extent.is_contiguous():
            raise OptimBufferError(
                f"extent: expected a flat contiguous uint8 tensor, got {extent.dtype} "
                f"{tuple(extent.shape)}"
            )
        if extent.numel() != self.nbytes:
            raise OptimBufferError(f"extent: {extent.numel()} bytes, expected {self.nbytes}")
        if extent.data_ptr() % ALIGN_BYTES:
            raise OptimBufferError(
                f"extent: address not {ALIGN_BYTES}-byte aligned (hint: use init_state_extent or "
                "a buffer from the pinned pool)"
            )
        sd = self.state_torch_dtype
        master = extent[: self.master_bytes].view(torch.float32)
        m = extent[self.m_offset : self.v_offset].view(sd)
        v = extent[self.v_offset :].view(sd)
        return master, m, v

    def param_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Shaped views of each parameter in a flat buffer of this layout (any dtype), no copy."""
        return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots}

    def flatten(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """New flat buffer of ``dtype`` holding ``tensors`` (by slot name) with zero padding.

        Raises:
            ConfigError: if a slot's tensor is missing, an extra one is given, or a shape differs.
        """
        names = {s.name for s in self.slots}
        if set(tensors) != names:
            diff = sorted(set(tensors) ^ names)
            raise ConfigError(f"tensors {diff} do not match the layout's slots (missing or extra)")
        flat = torch.zeros(self.numel, dtype=dtype)
        for s in self.slots:
            if tuple(tensors[s.name].shape) != s.shape:
                got = tuple(tensors[s.name].shape)
                raise ConfigError(f"{s.name}: shape {got}, layout says {s.shape}")
            flat[s.offset : s.offset + s.numel].copy_(tensors[s.name].reshape(-1))
        return flat


def layer_layout(
    params: Sequence[tuple[str, Sequence[int]]], state_dtype: str = "fp32"
) -> LayerStateLayout:
    """Lay out a layer's parameters, in the given order, each at an ``ALIGN_ELEMS`` boundary.

    Raises:
        ConfigError: on duplicate names, a negative dimension or an unknown ``state_dtype``.
    """
    slots, offset, seen = [], 0, set()
    for name, shape in params:
        if name in seen:
            raise ConfigError(f"parameter {name!r} appears twice in the layer")
        if any(d < 0 for d in shape):
            raise ConfigError(f"parameter {name!r} has a negative dimension: {tuple(shape)}")
        seen.add(name)
        slot = ParamSlot(name, tuple(int(d) for d in shape), offset)
        slots.append(slot)
        offset = _align(offset + slot.numel, ALIGN_ELEMS)
    return LayerStateLayout(tuple(slots), offset, state_dtype)


def init_state_extent(layout: LayerStateLayout, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """A fresh state extent (uint8, 64-byte aligned): master = weights in fp32, m = v = 0.

    Raises:
        ConfigError: if ``weights`` does not match the layout's slots.
    """
    raw = torch.zeros(layout.nbytes + ALIGN_BYTES, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN_BYTES
    extent = raw[skip : skip + layout.nbytes]
    master, _, _ = layout.views(extent)
    master.copy_(layout.flatten(weights, torch.float32))
    return extent
