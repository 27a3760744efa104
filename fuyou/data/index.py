"""The first pass over a JSONL file: validate every record and record where it is and its size.

The index holds three small arrays per record (byte offset int64, line number int64, token count
int32: 20 bytes a record) and no text or tokens, so a file of any size is indexed in constant
memory apart from them. Validating the whole file up front means a malformed line 900,000 fails
the run before the first step, not hours into it; the token counts give the exact number of packed
sequences per epoch and let a resumed run find its position without re-reading the data before it.
"""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass

import numpy as np

from fuyou.data.formats import MESSAGES, DataError, check_format_name, iter_records, resolve_format
from fuyou.data.tokenize import IGNORE_INDEX, Encoder


@dataclass(frozen=True)
class RecordIndex:
    """Where each record of one JSONL file is and how many tokens it encodes to."""

    path: str
    """The JSONL file."""
    fmt: str
    """The format every record is in (``text``, ``prompt_completion`` or ``messages``)."""
    offsets: np.ndarray
    """int64 [n_records]: byte offset of each record's line in the file."""
    lines: np.ndarray
    """int64 [n_records]: 1-based line number of each record (for error messages)."""
    lengths: np.ndarray
    """int32 [n_records]: tokens each record encodes to (ids and labels alike)."""
    n_loss_tokens: int
    """Tokens with a label other than -100, over the whole file."""
    file_size: int
    """Size of the file in bytes when indexed; a change during the run is reported."""
    mtime_ns: int
    """Modification time of the file when indexed (ns); a change during the run is reported."""

    @property
    def n_records(self) -> int:
        """Number of records (non-blank lines)."""
        return int(self.offsets.shape[0])

    @property
    def n_tokens(self) -> int:
        """Tokens in the whole file after tokenization."""
        return int(self.lengths.sum(dtype=np.int64))


def build_index(path: str | os.PathLike[str], encoder: Encoder, data_format: str = "auto") -> RecordIndex:
    """Stream ``path`` once: check every record, tokenize it, and record offset/line/length.

    ``data_format`` is ``auto`` (detect from the first record, all must match) or a format name.
    Raises ConfigError for an unknown format name and DataError for a missing file, a malformed
    or mismatched record (``file:line``), a ``messages`` file and a tokenizer without a chat
    template, an empty file, or a file in which no token carries loss.
    """
    auto = check_format_name(data_format) == "auto"
    fmt: str | None = None if auto else data_format
    offsets, lines, lengths = array("q"), array("q"), array("i")
    n_loss = 0
    p = os.fspath(path)
    for line_no, offset, record in iter_records(p):
        first = not offsets
        fmt = resolve_format(record, fmt, auto, p, line_no)
        if first and fmt == MESSAGES:
            encoder.check_chat_template(p)
        ids, labels = encoder.encode(record, fmt, p, line_no)
        offsets.append(offset)
        lines.append(line_no)
        lengths.append(len(ids))
        n_loss += sum(1 for t in labels if t != IGNORE_INDEX)
    if not offsets or fmt is None:
        raise DataError(f"{p}: the data file has no records (it is empty or only blank lines)")
    if n_loss == 0:
        raise DataError(
            f"{p}: no token carries loss (no completion or assistant text in "
            f"{len(offsets):,} records); nothing to train on"
        )
    return RecordIndex(
        path=p,
        fmt=fmt,
        offsets=np.frombuffer(offsets, dtype=np.int64).copy(),
        lines=np.frombuffer(lines, dtype=np.int64).copy(),
        lengths=np.frombuffer(lengths, dtype=np.int32).copy(),
        n_loss_tokens=n_loss,
        file_size=os.path.getsize(p),
        mtime_ns=os.stat(p).st_mtime_ns,
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
