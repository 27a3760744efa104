"""The first pass over the data: validate every record and record where it is and its size.

The data is one or more sources (``fuyou.data.sources``: JSONL files, Parquet files, ``datasets``
directories), read in order as one sequence of records. The index holds four small arrays per record
(source number int32, position int64 — a JSONL line's byte offset or a table's row —, line or row
number int64, token count int32: 24 bytes a record) and no text or tokens, so data of any size is
indexed in constant memory apart from them. Validating the whole file up front means a malformed line 900,000 fails
the run before the first step, not hours into it; the token counts give the exact number of packed
sequences per epoch and let a resumed run find its position without re-reading the data before it.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fuyou.data.formats import MESSAGES, DataError, check_format_name, resolve_format
from fuyou.data.sources import JsonlSource, Source, TableSource, open_sources
from fuyou.data.tokenize import IGNORE_INDEX, Encoder


@dataclass(frozen=True)
class RecordIndex:
    """Where each record of the data is and how many tokens it encodes to."""

    sources: tuple[Source, ...]
    """The files or tables, in order (``fuyou.data.sources``)."""
    fmt: str
    """The format every record is in (``text``, ``prompt_completion`` or ``messages``)."""
    source_ids: np.ndarray
    """int32 [n_records]: which of ``sources`` each record is in."""
    offsets: np.ndarray
    """int64 [n_records]: where each record is in its source (a JSONL line's byte offset, a table's row)."""
    lines: np.ndarray
    """int64 [n_records]: 1-based line (JSONL) or row (tables) number of each record (for error messages)."""
    lengths: np.ndarray
    """int32 [n_records]: tokens each record encodes to (ids and labels alike)."""
    n_loss_tokens: int
    """Tokens with a label other than -100, over all the data."""

    @property
    def path(self) -> str:
        """The data's name in messages: the one source, or the first and how many more."""
        first = self.sources[0].name
        return first if len(self.sources) == 1 else f"{first} (+{len(self.sources) - 1} more)"

    @property
    def fingerprint(self) -> str:
        """Identifies the data for a resume: the sources' fingerprints in order (one JSONL file: ``name:bytes``)."""
        return "+".join(s.fingerprint for s in self.sources)

    @property
    def n_records(self) -> int:
        """Number of records (non-blank lines)."""
        return int(self.offsets.shape[0])

    @property
    def n_tokens(self) -> int:
        """Tokens in the whole file after tokenization."""
        return int(self.lengths.sum(dtype=np.int64))


def build_index(
    data: str | os.PathLike[str] | Sequence[str] | Sequence[Source],
    encoder: Encoder,
    data_format: str = "auto",
    columns: Mapping[str, str] | None = None,
) -> RecordIndex:
    """Stream the data once: check every record, tokenize it, and record source/position/number/length.

    ``data``: a JSONL path, ``--data`` specs (``fuyou.data.sources.open_sources``, with the ``columns``
    mapping) or sources already open. ``data_format`` is ``auto`` (detect from the first record; every
    record of every source must match) or a format name. Raises ConfigError for an unknown format name
    and DataError for a missing file, a malformed or mismatched record (``file:line`` or ``name:row``),
    ``messages`` data and a tokenizer without a chat template, data without records, or data in which
    no token carries loss.
    """
    auto = check_format_name(data_format) == "auto"
    fmt: str | None = None if auto else data_format
    opened = not isinstance(data, (str, os.PathLike)) and all(isinstance(s, (JsonlSource, TableSource)) for s in data)
    sources: list[Source] = list(data) if opened else open_sources(data, columns)  # type: ignore[arg-type]
    ids_of, offsets, lines, lengths = array("i"), array("q"), array("q"), array("i")
    n_loss = 0
    for k, src in enumerate(sources):
        p = src.name
        for line_no, offset, record in src.records():
            first = not offsets
            fmt = resolve_format(record, fmt, auto, p, line_no)
            if first and fmt == MESSAGES:
                encoder.check_chat_template(p)
            ids, labels = encoder.encode(record, fmt, p, line_no)
            ids_of.append(k)
            offsets.append(offset)
            lines.append(line_no)
            lengths.append(len(ids))
            n_loss += sum(1 for t in labels if t != IGNORE_INDEX)
    p = sources[0].name if len(sources) == 1 else f"{sources[0].name} (+{len(sources) - 1} more)"
    if not offsets or fmt is None:
        raise DataError(f"{p}: the data file has no records (it is empty or only blank lines)")
    if n_loss == 0:
        raise DataError(
            f"{p}: no token carries loss (no completion or assistant text in "
            f"{len(offsets):,} records); nothing to train on"
        )
    return RecordIndex(
        sources=tuple(sources),
        fmt=fmt,
        source_ids=np.frombuffer(ids_of, dtype=np.int32).copy(),
        offsets=np.frombuffer(offsets, dtype=np.int64).copy(),
        lines=np.frombuffer(lines, dtype=np.int64).copy(),
        lengths=np.frombuffer(lengths, dtype=np.int32).copy(),
        n_loss_tokens=n_loss,
    )


def split_records(
    n_records: int, eval_fraction: float, split_seed: int = 0, path: str = "<data>"
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministically split record numbers ``0..n_records-1`` into train and held-out sets.

    ``round(n_records * eval_fraction)`` records (at least one when the fraction is positive) are
    drawn by a numpy Generator seeded with ``split_seed``, independent of the training seed so
    runs with different seeds share a held-out set. Both arrays are sorted int64. Raises
    DataError when the split would leave no training record.
    """
    if eval_fraction <= 0:
        return np.arange(n_records, dtype=np.int64), np.empty(0, dtype=np.int64)
    n_eval = max(1, round(n_records * eval_fraction))
    if n_eval >= n_records:
        raise DataError(
            f"{path}: holding out {eval_fraction:g} of {n_records:,} records leaves none to train "
            "on; lower the eval fraction or add data"
        )
    perm = np.random.default_rng(split_seed).permutation(n_records)
    return np.sort(perm[n_eval:]).astype(np.int64), np.sort(perm[:n_eval]).astype(np.int64)
