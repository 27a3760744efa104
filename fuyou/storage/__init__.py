"""SSD-resident tensors: layout, I/O backends, checksums, manifest and the versioned store, and the
record a training store keeps of its run (``run_meta.StoreMeta``)."""

from fuyou.storage.extents import ExtentSpec, Piece, TensorSpec
from fuyou.storage.store import TensorStore

__all__ = ["ExtentSpec", "Piece", "TensorSpec", "TensorStore"]
