"""One call from user options to a training dataset and an optional held-out dataset."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from fuyou.data.formats import TEXT, check_format_name
from fuyou.data.index import build_index, split_records
from fuyou.data.loader import PackedDataset
from fuyou.data.sources import parse_columns
from fuyou.data.tokenize import Encoder
from fuyou.errors import ConfigError


def check_seq_len(seq_len: int, max_positions: int | None = None) -> int:
    """Return ``seq_len`` if it is a positive int within the model's ``max_positions``.

    Raises ConfigError naming ``--seq-len`` otherwise.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"--seq-len must be a positive integer, got {seq_len!r}")
    if max_positions is not None and seq_len > max_positions:
        raise ConfigError(
            f"--seq-len {seq_len:,} is above the model's maximum of {max_positions:,} positions "
            f"(max_position_embeddings); lower --seq-len to {max_positions:,} or less"
        )
    return seq_len


def build_datasets(
    path: str | os.PathLike[str] | Sequence[str],
    tokenizer: Any,
    seq_len: int,
    *,
    data_format: str = "auto",
    seed: int = 0,
    max_positions: int | None = None,
    eval_fraction: float = 0.0,
    eval_path: str | os.PathLike[str] | None = None,
    split_seed: int = 0,
    packing: str = "auto",
    columns: str | Mapping[str, str] | None = None,
) -> tuple[PackedDataset, PackedDataset | None]:
    """Index, validate and split the data; return ``(train, held_out or None)``.

    ``path`` is the training data: a JSONL file or ``--data`` specs (files, globs, Parquet, ``datasets``
    directories, hub dataset ids: ``fuyou.data.sources``), read through the ``columns`` mapping
    (``prompt=instruction,completion=output`` or a dict); ``seq_len`` tokens per packed sequence; ``data_format`` is
    ``auto`` or a format name; ``seed`` orders the training records per epoch;
    ``max_positions`` is the model's maximum sequence length (None = unchecked). The held-out set
    is either ``eval_fraction`` of the records of ``path`` (split with ``split_seed``) or the
    whole of ``eval_path``; it is packed in file order and never shuffled. ``packing``: ``concat``,
    ``documents`` (each document attends only to itself: ``fuyou.data.packing``) or ``auto``
    (``documents`` for prompt/completion and messages data, ``concat`` for plain text).

    Raises ConfigError for a bad ``seq_len``, seed, format name or fraction, or both held-out
    options; DataError for anything wrong with the data (see
    :func:`fuyou.data.index.build_index`) or a training/held-out set with fewer tokens than one
    sequence.
    """
    check_seq_len(seq_len, max_positions)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"--seed must be a non-negative integer, got {seed!r}")
    check_format_name(data_format)
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction > 0 and eval_path is not None:
        raise ConfigError("give either an eval fraction or an eval file, not both")
    cols = parse_columns(columns)
    encoder = Encoder(tokenizer)
    index = build_index(path, encoder, data_format, cols)
    train_ids, eval_ids = split_records(index.n_records, eval_fraction, split_seed, index.path)
    name = index.path if eval_fraction <= 0 else f"{index.path} (training split)"
    if packing not in ("auto", "concat", "documents"):
        raise ConfigError(f"--packing must be auto, concat or documents, got {packing!r}")
    if packing == "auto":
        packing = "concat" if index.fmt == TEXT else "documents"
    train = PackedDataset(index, encoder, seq_len, train_ids, shuffle=True, seed=seed, name=name, packing=packing)
    held_out: PackedDataset | None = None
    if len(eval_ids):
        held = f"{index.path} (held-out {eval_fraction:g} split)"
        held_out = PackedDataset(index, encoder, seq_len, eval_ids, shuffle=False, name=held, packing=packing)
    elif eval_path is not None:
        eval_index = build_index(eval_path, encoder, data_format, cols)
        held = f"{eval_index.path} (held-out file)"
        held_out = PackedDataset(eval_index, encoder, seq_len, shuffle=False, name=held, packing=packing)
    return train, held_out
