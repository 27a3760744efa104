"""Training data: JSONL, Parquet or ``datasets`` records (``fuyou.data.sources``) → tokens with loss labels → packed, shuffled, resumable batches.

Typical use::

    from fuyou.data import BatchLoader, build_datasets
    train, held_out = build_datasets("data.jsonl", tokenizer, seq_len=1024, seed=0,
                                     max_positions=config.max_position_embeddings,
                                     eval_fraction=0.05)
    loader = BatchLoader(train, batch_size=micro_batch_size * grad_accum)
    for batch in loader.batches(steps=1000):   # {"input_ids", "labels"}: torch.long [B, T]
        ...
        saved = loader.state_dict()            # JSON-serialisable; load_state_dict(saved) resumes

Names are imported lazily so ``import fuyou.data`` does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "DataError": "fuyou.data.formats",
    "FORMATS": "fuyou.data.formats",
    "iter_records": "fuyou.data.formats",
    "Encoder": "fuyou.data.tokenize",
    "IGNORE_INDEX": "fuyou.data.tokenize",
    "RecordIndex": "fuyou.data.index",
    "build_index": "fuyou.data.index",
    "split_records": "fuyou.data.index",
    "pack": "fuyou.data.packing",
    "PackedDataset": "fuyou.data.loader",
    "BatchLoader": "fuyou.data.loader",
    "LoaderState": "fuyou.data.loader",
    "build_datasets": "fuyou.data.build",
    "check_seq_len": "fuyou.data.build",
    "write_demo_dataset": "fuyou.data.demo_corpus",
    "open_sources": "fuyou.data.sources",
    "parse_columns": "fuyou.data.sources",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import ``name`` from its submodule on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fuyou.data' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
