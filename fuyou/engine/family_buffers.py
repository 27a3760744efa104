"""The family's persistent buffers: stored once per block, held on the device through the run.

A few families keep values in their checkpoints that are no parameters and never train: the
aux-loss-free router bias ``e_score_correction_bias`` of DeepSeek-V3, GLM-4.5 and their kin, one per
expert per layer. ``transformers`` keeps them in fp32 even in a bf16 model
(``_keep_in_fp32_modules_strict``): they decide which experts a token goes to, and bf16 would round
them. Fuyou stores each block's in its extent ``ModelLayout.k`` in that dtype (``BlockSpec.buffers``),
writes it at import, reads all of them into device memory once per run (kilobytes: 58 MoE layers ×
256 experts × 4 B for DeepSeek-V3) and binds them with the block's weights (``Adapter.bind``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from fuyou.device.base import Backend
from fuyou.models.store_layout import ModelLayout


def write_buffers(tier: Any, layout: ModelLayout, b: int, src: dict[str, torch.Tensor]) -> None:
    """Import: write block ``b``'s buffers from the checkpoint's tensors ``src`` (by HF key, any dtype)
    into its extent through ``tier`` (``RamTier.write_through``); nothing if it has none. Raises
    KeyError naming a buffer ``src`` lacks."""
    ext = layout.k(b)
    if ext is None:
        return
    raw = torch.zeros(ext.nbytes, dtype=torch.uint8)
    for key, view in ext.views(raw).items():
        view.copy_(src[key].reshape(view.shape))
    tier.write_through(ext.name, raw).result()


def read_buffers(store: Any, layout: ModelLayout, b: int) -> dict[str, torch.Tensor]:
    """Block ``b``'s buffers as stored (host tensors by HF key, in their kept dtype); empty if none."""
    ext = layout.k(b)
    if ext is None:
        return {}
    raw = torch.empty(ext.nbytes, dtype=torch.uint8)
    store.read(ext.name, raw).result()
    return ext.views(raw)  # views of this call's own buffer: nothing else writes it


def iter_buffers(store: Any, layout: ModelLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, host tensor) of every block's buffers, block by block."""
    for b in range(len(layout.blocks)):
        yield from read_buffers(store, layout, b).items()


def hold_buffers(store: Any, layout: ModelLayout, backend: Backend) -> dict[str, torch.Tensor]:
    """Every block's buffers in device memory for the run (counted against the capacity; raises
    DeviceMemoryError past it), by HF key."""
    out = {}
    for key, host in iter_buffers(store, layout):
        dev = backend.device_empty(tuple(host.shape), host.dtype, f"the family's buffer {key}")
        dev.copy_(host)
        out[key] = dev
    return out
