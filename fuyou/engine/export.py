"""Reading trained weights back out of a store: fp32 masters per parameter, and HF directories.

``export_store`` needs only the store directories (or a run directory): the engine keeps the model's
config and tokenizer files in ``<first store dir>/hf-model-files`` and the layout facts (dtypes,
state chunk) in every commit's metadata.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fuyou.errors import ConfigError, ManifestError
from fuyou.models.hf_io import load_config, save_streamed
from fuyou.models.store_layout import ModelLayout
from fuyou.storage.extents import dtype_from_name
from fuyou.storage.store import TensorStore
from fuyou.transfer.ram_tier import RamTier, refuse_stale

HF_FILES = "hf-model-files"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def iter_master(
    store: TensorStore | RamTier,
    layout: ModelLayout,
    gather: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, fp32 master tensor) for every parameter, one block at a time (latest writes).

    A sharded layout (``layout.world`` > 1) needs ``gather``: every rank's shard of a block's master
    in rank order on one rank (``Collectives.gather_to_root``), None on the others, which then yield
    nothing but must run the generator to its end, in step with that rank."""
    for b in range(len(layout.blocks)):
        master: torch.Tensor | None = torch.empty(layout.numel(b), dtype=torch.float32)
        assert master is not None
        for c, (lo, hi) in enumerate(layout.chunks(b)):
            s = torch.empty(layout.s(b, c).nbytes, dtype=torch.uint8)
            store.read(layout.s(b, c).name, s).result()
            master[lo:hi] = layout.s(b, c).views(s)["master"]
        if layout.world > 1:
            if gather is None:
                raise ValueError("a sharded layout's masters need a gather across ranks")
            master = gather(master)
            if master is None:
                continue
        yield from layout.unflatten(b, master).items()


def export_layout(
    store: TensorStore | RamTier,
    layout: ModelLayout,
    config: Any,
    out_dir: str,
    dtype: str,
    copy_from: str | None,
    gather: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> None:
    """Write the store's current weights as a Hugging Face model directory in ``dtype``; a sharded
    layout streams its blocks through ``gather`` (``iter_master``) and only the rank it gathers on
    writes."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be bf16 or fp32, got {dtype!r}")
    gen = ((k, t.to(DTYPES[dtype])) for k, t in iter_master(store, layout, gather))
    if layout.world > 1 and layout.rank != 0:
        for _ in gen:  # the other ranks send their shards, block by block
            pass
        return
    save_streamed(out_dir, gen, config, DTYPES[dtype], copy_from=copy_from)


def _store_dirs(paths: list[str]) -> list[str]:
    """Store directories from a run directory (its run.json) or as given."""
    if len(paths) == 1 and os.path.isfile(os.path.join(paths[0], "run.json")):
        with open(os.path.join(paths[0], "run.json")) as f:
            return list(json.load(f)["store_dirs"])
    return paths


def export_store(paths: list[str], out_dir: str, dtype: str = "bf16") -> None:
    """``fuyou export``: a run directory or store directories → a Hugging Face model directory.

    Raises ManifestError if the store lacks the model files or layout facts (not a Fuyou run store),
    StoreError if its last committed step kept host-RAM-tier extents never written back (export a
    checkpoint, or resume and let the run finish).
    """
    from fuyou.models.adapters import make_adapter

    dirs = _store_dirs(paths)
    files = os.path.join(dirs[0], HF_FILES)
    with TensorStore.open(dirs) as store:
        meta = store.meta
        if not os.path.isdir(files) or "compute_dtype" not in meta:
            raise ManifestError(
                f"{dirs[0]} is not a Fuyou training store (no model files or layout); pass a run "
                "directory or the --ssd directories of a run"
            )
        refuse_stale(meta, dirs[0])
        if meta.get("world", 1) > 1:
            raise ConfigError(
                f"{dirs[0]} holds rank {meta['rank']}'s shard of a {meta['world']}-rank run; a run's "
                "model/ directory holds the whole model (exported at its end), or resume the run with "
                "torchrun and the same number of ranks"
            )
        config = load_config(files)
        layout = ModelLayout(
            tuple(make_adapter(config).blocks),
            dtype_from_name(meta["compute_dtype"]),
            dtype_from_name(meta["state_dtype"]),
            meta["state_chunk"],
        )
        export_layout(store, layout, config, out_dir, dtype, files)
