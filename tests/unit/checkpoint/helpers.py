"""A small striped store for the checkpoint tests."""

from __future__ import annotations

import torch

from fuyou.storage import ExtentSpec, TensorSpec, TensorStore


def make_store(tmp_path, n: int, ndirs: int = 2, stripe_min: int = 1 << 16) -> tuple[TensorStore, list[ExtentSpec]]:
    """A new store over ``ndirs`` directories ``s0``… of ``tmp_path``: 3 fp32 extents of ``n``
    elements, 64 KiB I/O blocks, pieces striped from ``stripe_min`` bytes."""
    dirs = []
    for i in range(ndirs):
        (tmp_path / f"s{i}").mkdir()
        dirs.append(str(tmp_path / f"s{i}"))
    exts = [ExtentSpec(f"e{i}", (TensorSpec("w", (n,), torch.float32),)) for i in range(3)]
    return TensorStore.create(dirs, exts, block_bytes=64 << 10, stripe_min=stripe_min), exts
