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

from fuyou.engine.family_buffers import read_buffers
from fuyou.errors import ConfigError, ManifestError
from fuyou.models.blocks import parse_slice
from fuyou.models.families import untrained
from fuyou.models.freeze import frozen_blocks, frozen_keys
from fuyou.models.hf_io import load_config, save_streamed
from fuyou.models.store_layout import ModelLayout
from fuyou.optim.split import read_flags, split_decode
from fuyou.schedule.state_format import state_format
from fuyou.storage.run_meta import EXPORT_DTYPES, StoreMeta
from fuyou.storage.store import TensorStore
from fuyou.transfer.ram_tier import RamTier, refuse_stale

HF_FILES = "hf-model-files"
CHECKPOINTS = "checkpoints"
"""Where a store keeps its checkpoints (``fuyou.checkpoint.snapshot.CKPT``, which this layer does not import)."""


def export_dtype(dtype: str, meta: StoreMeta) -> torch.dtype:
    """The dtype to write for ``--dtype`` (``auto``: the dtype of the checkpoint the run started from, the
    store's ``source_dtype``; a store from before it was recorded: its compute dtype). Raises ConfigError
    for another name."""
    if dtype == "auto":
        return meta.source_dtype
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype must be auto, {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    return EXPORT_DTYPES[dtype]


def read_master(store: TensorStore | RamTier, layout: ModelLayout, b: int) -> torch.Tensor:
    """Block ``b``'s fp32 master vector as ``store`` holds it (this rank's shard when sharded); a
    frozen block's (no optimizer state: a LoRA base, ``--freeze``) is its compute weights, which
    never change."""
    if not layout.trains(b):
        if layout.origin:
            return read_origin(store, layout, b)
        w = torch.empty(layout.w(b).nbytes, dtype=torch.uint8)
        store.read(layout.w(b).name, w).result()
        return w.view(layout.compute_dtype)[: layout.numel(b)].float()
    if layout.optimizer_state.split:
        w = torch.empty(layout.w(b).nbytes, dtype=torch.uint8)
        store.read(layout.w(b).name, w).result()
        weights = w.view(layout.compute_dtype)[: layout.numel(b)]
        if layout.compute_dtype == torch.float32:
            return weights.clone()
    master = torch.empty(layout.numel(b), dtype=torch.float32)
    for c, (lo, hi) in enumerate(layout.chunks(b)):
        s = torch.empty(layout.s(b, c).nbytes, dtype=torch.uint8)
        store.read(layout.s(b, c).name, s).result()
        views = layout.s(b, c).views(s)
        if layout.optimizer_state.split:
            master[lo:hi] = split_decode(weights[lo:hi], views["rem"], read_flags(views["rem"], views["v"]))
        else:
            master[lo:hi] = views["master"]
    return master


def read_origin(store: TensorStore | RamTier, layout: ModelLayout, b: int) -> torch.Tensor:
    """Block ``b``'s frozen values as the checkpoint had them (``layout.o``, fp32; this rank's shard):
    the whole block's vector if it does not train, else its read-only part's."""
    ranges = layout.origin_chunks(b)
    out = torch.empty(ranges[-1][1] if ranges else 0, dtype=torch.float32)
    for c, (lo, hi) in enumerate(ranges):
        ext = layout.o(b, c)
        raw = torch.empty(ext.nbytes, dtype=torch.uint8)
        store.read(ext.name, raw).result()
        out[lo:hi] = ext.views(raw)["origin"]
    return out


def read_frozen(store: TensorStore | RamTier, layout: ModelLayout, b: int) -> torch.Tensor | None:
    """Block ``b``'s read-only part (``layout.f``: parameters ``--freeze`` froze in a block that trains)
    as fp32 (this rank's shard when sharded), or None if it has none."""
    f = layout.f(b)
    if f is None:
        return None
    if layout.origin:
        return read_origin(store, layout, b)
    w = torch.empty(f.nbytes, dtype=torch.uint8)
    store.read(f.name, w).result()
    return w.view(layout.compute_dtype)[: layout.frozen_numel(b)].float()


def iter_master(
    store: TensorStore | RamTier,
    layout: ModelLayout,
    gather: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, fp32 master tensor) for every parameter, one block at a time (latest writes; a split
    layer's expert groups joined: ``merge_expert_groups``), and the family's buffers as stored (in the
    dtype it keeps them in: ``fuyou.engine.family_buffers``).

    A sharded layout (``layout.world`` > 1) needs ``gather``: every rank's shard of a block's master
    in rank order on one rank (``Collectives.gather_to_root``), None on the others, which then yield
    nothing but must run the generator to its end, in step with that rank."""
    if layout.world > 1 and gather is None:
        raise ValueError("a sharded layout's masters need a gather across ranks")

    def blocks() -> Iterator[tuple[str, torch.Tensor]]:
        def gathered(part: torch.Tensor) -> torch.Tensor | None:
            return gather(part) if gather is not None and layout.world > 1 else part

        for b in range(len(layout.blocks)):
            whole = gathered(read_master(store, layout, b))
            frozen = read_frozen(store, layout, b)
            rest = gathered(frozen) if frozen is not None else None
            if whole is not None:
                yield from layout.unflatten(b, whole if rest is None else torch.cat([whole, rest])).items()
                yield from read_buffers(store, layout, b).items()

    return merge_expert_groups(blocks())


def _iter_ranks(stores: list[TensorStore], layouts: list[ModelLayout]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, fp32 master) of a run whose ranks' stores are all here: each block's shards put together."""

    def blocks() -> Iterator[tuple[str, torch.Tensor]]:
        for b in range(len(layouts[0].blocks)):
            parts = [read_master(st, lay, b) for st, lay in zip(stores, layouts)]
            parts += [f for st, lay in zip(stores, layouts) if (f := read_frozen(st, lay, b)) is not None]
            yield from layouts[0].unflatten(b, torch.cat(parts)).items()
            yield from read_buffers(stores[0], layouts[0], b).items()  # every rank holds them whole

    return merge_expert_groups(blocks())


def merge_expert_groups(pairs: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` pairs with every expert group's slices (``fuyou.models.blocks.slice_key``) put
    back together along dim 0 under the fused tensor's own key (and a vocabulary split's rows: the
    embedding's, the LM head's); a layer's groups come one after the other, so at most one layer's
    experts are held. A block's whole tensors come before its slices (``blocks.split_vocab``)."""
    pending: dict[str, list[torch.Tensor]] = {}
    for key, t in pairs:
        rows = parse_slice(key)
        if rows is None:
            yield from _joined(pending)
            yield key, t
        else:
            pending.setdefault(rows[0], []).append(t)
    yield from _joined(pending)


def _joined(pending: dict[str, list[torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The fused tensors of ``pending``'s slices (in group order), emptying it."""
    for key, parts in list(pending.items()):
        yield key, torch.cat(parts)
        del pending[key]


def export_cast(layout: ModelLayout, dtype: torch.dtype) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """(key, tensor) → the tensor export writes: in ``dtype``, but a buffer the family keeps in fp32
    (``BufferSpec.fp32``: DeepSeek-V3's router biases) in fp32 whatever ``dtype``, as ``transformers``
    holds it, so a bf16 export does not round it."""
    keep = {x.key for blk in layout.blocks for x in blk.buffers if x.fp32}
    return lambda k, t: t.float() if k in keep else t.to(dtype)


def export_layout(
    store: TensorStore | RamTier,
    layout: ModelLayout,
    config: Any,
    out_dir: str,
    dtype: torch.dtype,
    copy_from: str | None,
    gather: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Write the store's current weights as a Hugging Face model directory in ``dtype``; a sharded
    layout streams its blocks through ``gather`` (``iter_master``) and only the rank it gathers on
    writes. ``transform(key, fp32 tensor)``, if given, changes each tensor first (LoRA merged in)."""
    change = transform or (lambda _k, t: t)
    cast = export_cast(layout, dtype)
    gen = ((k, cast(k, change(k, t))) for k, t in iter_master(store, layout, gather))
    if layout.world > 1 and layout.rank != 0:
        for _ in gen:  # the other ranks send their shards, block by block
            pass
        return
    save_streamed(out_dir, gen, config, dtype, copy_from=copy_from)


def _store_dirs(paths: list[str], checkpoint: str | None = None) -> list[str]:
    """Store directories from a run directory (its run.json) or as given; a multi-rank run's hold
    ``{rank}``. ``checkpoint``: that checkpoint's directories in them instead (``best``: the
    ``--keep-best`` one run.json names). Raises ConfigError for ``best`` without a run that kept one."""
    run = os.path.join(paths[0], "run.json")
    summary = None
    if len(paths) == 1 and os.path.isfile(run):
        with open(run) as f:
            summary = json.load(f)
        paths = list(summary["store_dirs"])
    if checkpoint == "best":
        best = (summary or {}).get("best_checkpoint")
        if not best:
            raise ConfigError(
                f"--checkpoint best needs a run directory whose run.json names a best checkpoint (a finished run "
                f"with --eval-every N --keep-best); {paths[0]} is not one: pass the checkpoint's name"
            )
        checkpoint = os.path.basename(best)
    return [os.path.join(d, CHECKPOINTS, checkpoint) for d in paths] if checkpoint else paths


def _model_files(first: str) -> str:
    """The model-files directory of the store in ``first``; a checkpoint (``<store>/checkpoints/<name>``)
    shares its store's."""
    files = os.path.join(first, HF_FILES)
    parent = os.path.dirname(os.path.abspath(first).rstrip("/"))
    if not os.path.isdir(files) and os.path.basename(parent) == CHECKPOINTS:
        return os.path.join(os.path.dirname(parent), HF_FILES)
    return files


def export_store(paths: list[str], out_dir: str, dtype: str = "auto", checkpoint: str | None = None) -> None:
    """``fuyou export``: a run directory or store directories → a Hugging Face model directory. A run
    of several ranks (``torchrun``) is read from every rank's store, block by block. ``checkpoint``:
    export that checkpoint of the run (its name, or ``best``: ``--keep-best``'s) instead of its last
    step; a checkpoint's own directory (``<store>/checkpoints/<name>``) works as a store directory too.

    Raises ManifestError if the store lacks the model files or layout facts (not a Fuyou run store),
    StoreError if its last committed step kept host-RAM-tier extents never written back (export a
    checkpoint, or resume and let the run finish), ConfigError for one rank's store of several, or
    ranks whose stores are at different steps.
    """
    from fuyou.storage.dirs import RANK_FIELDS, rank_dirs

    template = _store_dirs(paths, checkpoint)
    ranked = any(f in d for d in template for f in RANK_FIELDS)
    first = rank_dirs(template, 0, 2 if ranked else 1, 0)
    with TensorStore.open(first) as store:
        layout, config, files = _store_layout(store, first[0], ranked)
        meta = StoreMeta.from_json(store.meta, first[0])
        world, out_dtype = layout.world, export_dtype(dtype, meta)
        if world == 1:
            export_layout(store, layout, config, out_dir, out_dtype, files)
            return
    if not ranked:
        raise ConfigError(
            f"{first[0]} holds rank {meta.rank}'s shard of a {world}-rank run; pass the run directory "
            "(its run.json names every rank's store) or resume the run with torchrun and as many ranks"
        )
    dirs = [rank_dirs(template, r, world, r) for r in range(world)]
    stores = [TensorStore.open(d) for d in dirs]
    try:
        layouts = [_store_layout(st, d[0], True)[0] for st, d in zip(stores, dirs)]
        steps = {StoreMeta.from_json(st.meta, d[0]).step for st, d in zip(stores, dirs)}
        if len(steps) > 1 or [lay.rank for lay in layouts] != list(range(world)):
            raise ConfigError(
                f"the ranks' stores of {paths[0]} are at different steps ({sorted(steps)}) or out of order; "
                "export a run that finished, or resume it with torchrun and --resume auto"
            )
        cast = export_cast(layouts[0], out_dtype)
        gen = ((k, cast(k, t)) for k, t in _iter_ranks(stores, layouts))
        save_streamed(out_dir, gen, config, out_dtype, copy_from=files)
    finally:
        for st in stores:
            st.close()


def _store_layout(store: TensorStore, first: str, ranked: bool) -> tuple[ModelLayout, Any, str]:
    """The layout (its rank and world included), model config and model-files directory of an open
    store whose first directory is ``first``; raises ManifestError / StoreError as ``export_store``."""
    from fuyou.models.adapters import make_adapter

    files = _model_files(first)
    if not os.path.isdir(files):
        raise ManifestError(
            f"{first} is not a Fuyou training store (no model files); pass a run directory or the --ssd "
            "directories of a run"
        )
    refuse_stale(store.meta, first)
    meta = StoreMeta.from_json(store.meta, first)
    config = load_config(files)
    blocks = tuple(make_adapter(config, expert_groups=meta.expert_groups, vocab_groups=meta.vocab_groups).blocks)
    layout = ModelLayout(
        blocks,
        meta.compute_dtype,
        state_format(meta.optimizer_state, resumable=True),
        meta.state_chunk,
        meta.rank,
        meta.world,
        meta.lora_base,
        frozen_blocks=frozen_blocks(blocks, meta.freeze, untrained(config)),
        frozen_params=frozen_keys(blocks, meta.freeze, untrained(config)),
        origin=meta.origin,
    )
    return layout, config, files
