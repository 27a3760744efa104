"""Where every tensor lives on disk: tensors grouped into extents, extents striped into pieces.

An *extent* is the unit of I/O: one model layer's tensors of one state class (e.g. layer 3's
fp32 master weights), packed contiguously with 64-byte tensor alignment so a layer moves in one
large I/O. An extent is cut into *pieces*, one per stripe directory (one per SSD), so a single
layer's read uses every drive at once; extents under ``stripe_min`` bytes stay in one directory.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from fuyou.errors import ConfigError
from fuyou.units import TENSOR_ALIGN, align_up

FILE_ALIGN = 4096
"""Byte alignment of pieces and I/O blocks on disk (O_DIRECT's logical block size)."""

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def dtype_from_name(name: str) -> torch.dtype:
    """Map ``"bfloat16"`` etc. to a torch dtype; raises ConfigError for unknown names."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, shape and dtype (no data)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict:
        """Plain-data form for the manifest."""
        return {"name": self.name, "shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")}

    @staticmethod
    def from_json(d: dict) -> TensorSpec:
        """Inverse of ``to_json``."""
        return TensorSpec(d["name"], tuple(d["shape"]), dtype_from_name(d["dtype"]))


@dataclass(frozen=True)
class ExtentSpec:
    """A named group of tensors stored contiguously; ``offsets`` are byte offsets of each tensor."""

    name: str
    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ConfigError(f"extent {self.name!r} has duplicate tensor names")

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each tensor (64-byte aligned); computed once (the engine asks per block and step)."""
        out, pos = [], 0
        for t in self.tensors:
            pos = align_up(pos, TENSOR_ALIGN)
            out.append(pos)
            pos += t.nbytes
        return tuple(out)

    @functools.cached_property
    def nbytes(self) -> int:
        """Logical size in bytes: end of the last tensor."""
        if not self.tensors:
            return 0
        return self.offsets[-1] + self.tensors[-1].nbytes

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed, shaped views of each tensor inside a uint8 buffer holding this extent."""
        if buf.dtype != torch.uint8 or buf.numel() < self.nbytes:
            raise ConfigError(f"extent {self.name!r} needs a uint8 buffer of ≥ {self.nbytes} bytes")
        return {
            t.name: buf[off : off + t.nbytes].view(t.dtype).view(t.shape) for t, off in zip(self.tensors, self.offsets)
        }

    def to_json(self) -> dict:
        """Plain-data form for the manifest."""
        return {"name": self.name, "tensors": [t.to_json() for t in self.tensors]}

    @staticmethod
    def from_json(d: dict) -> ExtentSpec:
        """Inverse of ``to_json``."""
        return ExtentSpec(d["name"], tuple(TensorSpec.from_json(t) for t in d["tensors"]))


@dataclass(frozen=True)
class Piece:
    """A contiguous part of an extent in one directory: bytes [start, start+length)."""

    dir_index: int
    start: int
    length: int

    @property
    def file_bytes(self) -> int:
        """Size of the file holding this piece (length rounded up to 4 KiB, at least 4 KiB)."""
        return max(align_up(self.length, FILE_ALIGN), FILE_ALIGN)


def place(extents: list[ExtentSpec], ndirs: int, stripe_min: int) -> list[tuple[Piece, ...]]:
    """Cut each extent into pieces across ``ndirs`` directories.

    Extents of at least ``stripe_min`` bytes are split into ``ndirs`` 4 KiB-aligned pieces (the
    first in a rotating directory, so short last pieces spread out); smaller ones go whole to the
    least-loaded directory. Returns one tuple of pieces per extent, in order.
    """
    load = [0] * ndirs
    out: list[tuple[Piece, ...]] = []
    for i, ext in enumerate(extents):
        n = ext.nbytes
        if ndirs == 1 or n < stripe_min:
            d = min(range(ndirs), key=load.__getitem__)
            pieces: tuple[Piece, ...] = (Piece(d, 0, n),)
        else:
            step = align_up(-(-n // ndirs), FILE_ALIGN)
            starts = [s for s in range(0, n, step)]
            pieces = tuple(Piece((i + k) % ndirs, s, min(step, n - s)) for k, s in enumerate(starts))
        for p in pieces:
            load[p.dir_index] += p.file_bytes
        out.append(pieces)
    return out
