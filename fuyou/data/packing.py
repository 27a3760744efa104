"""Packing: documents concatenated into one token stream, cut into sequences of exactly ``seq_len``.

Document ``i`` is followed directly by document ``i+1`` (each document already ends with its EOS
or end-of-turn token); a document may be split across two sequences. The final partial sequence
of an epoch (fewer than ``seq_len`` tokens) is dropped, so an epoch has
``total_tokens // seq_len`` sequences whatever the document order. There is no padding and no
per-document attention mask (the usual GPT-style packing).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np


def num_sequences(total_tokens: int, seq_len: int) -> int:
    """Full sequences of ``seq_len`` tokens in a stream of ``total_tokens`` tokens."""
    return total_tokens // seq_len


def locate(lengths: np.ndarray, token_pos: int) -> tuple[int, int]:
    """Find stream token ``token_pos`` given per-document token counts in stream order.

    Returns ``(doc_pos, offset)``: the position of the document holding that token within
    ``lengths`` and the token's offset inside it. Zero-length documents are skipped. Raises
    ValueError if ``token_pos`` is not inside the stream.
    """
    if token_pos == 0:
        return 0, 0
    ends = np.cumsum(lengths, dtype=np.int64)
    if token_pos < 0 or token_pos >= int(ends[-1]):
        raise ValueError(f"token {token_pos} is outside a stream of {int(ends[-1])} tokens")
    doc = int(np.searchsorted(ends, token_pos, side="right"))
    start = int(ends[doc - 1]) if doc else 0
    return doc, token_pos - start


def pack(
    docs: Iterable[tuple[Sequence[int], Sequence[int]]], seq_len: int, skip: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(input_ids, labels)`` int64 arrays of exactly ``seq_len`` tokens from ``docs``.

    ``docs`` yields ``(ids, labels)`` pairs of equal length, consumed lazily; the first ``skip``
    tokens of the stream are discarded (to resume inside a document). A trailing remainder
    shorter than ``seq_len`` is dropped. Only up to one sequence plus one document is held.
    Raises ValueError for ``seq_len < 1`` or ids and labels of different lengths.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    buf_ids = np.empty(0, dtype=np.int64)
    buf_labels = np.empty(0, dtype=np.int64)
    for ids, labels in docs:
        if len(ids) != len(labels):
            raise ValueError(f"ids ({len(ids)}) and labels ({len(labels)}) differ in length")
        a = np.asarray(ids, dtype=np.int64)
        b = np.asarray(labels, dtype=np.int64)
        if skip:
            cut = min(skip, len(a))
            a, b, skip = a[cut:], b[cut:], skip - cut
        buf_ids = np.concatenate([buf_ids, a])
        buf_labels = np.concatenate([buf_labels, b])
        n_full = len(buf_ids) // seq_len
        for i in range(n_full):
            lo = i * seq_len
            yield buf_ids[lo : lo + seq_len], buf_labels[lo : lo + seq_len]
        buf_ids = buf_ids[n_full * seq_len :]
        buf_labels = buf_labels[n_full * seq_len :]
