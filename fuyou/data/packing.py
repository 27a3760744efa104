"""Packing: documents concatenated into one token stream, cut into sequences of exactly ``seq_len``.

Document ``i`` is followed directly by document ``i+1`` (each document already ends with its EOS
or end-of-turn token); a document may be split across two sequences. The final partial sequence
of an epoch (fewer than ``seq_len`` tokens) is dropped, so an epoch has
``total_tokens // seq_len`` sequences whatever the document order. There is no padding.

``concat`` packing (the usual GPT-style packing) has no per-document attention: a document attends to
the ones before it in its sequence. ``documents`` packing also yields each token's position inside its
document (0 at every document start; a document split across two sequences continues its count), from
which the model's mask functions make a block-diagonal mask (``transformers`` detects packed
sequences from position ids), and it drops the label of every document's first token, so the last
token of one document is not trained to predict the next document: each document trains as if alone.
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


PACKINGS = ("concat", "documents")


def pack(
    docs: Iterable[tuple[Sequence[int], Sequence[int]]], seq_len: int, skip: int = 0, documents: bool = False
) -> Iterator[tuple[np.ndarray, ...]]:
    """Yield ``(input_ids, labels)`` int64 arrays of exactly ``seq_len`` tokens from ``docs``, and with
    ``documents`` each token's position in its document as a third array (see the module docstring).

    ``docs`` yields ``(ids, labels)`` pairs of equal length, consumed lazily; the first ``skip``
    tokens of the stream are discarded (to resume inside a document). A trailing remainder
    shorter than ``seq_len`` is dropped. Only up to one sequence plus one document is held.
    Raises ValueError for ``seq_len < 1`` or ids and labels of different lengths.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    width = 3 if documents else 2
    bufs = [np.empty(0, dtype=np.int64) for _ in range(width)]
    for ids, labels in docs:
        if len(ids) != len(labels):
            raise ValueError(f"ids ({len(ids)}) and labels ({len(labels)}) differ in length")
        parts = [np.asarray(ids, dtype=np.int64), np.array(labels, dtype=np.int64)]
        if documents:
            if len(parts[1]):
                parts[1][0] = -100  # the previous document's last token does not predict this one
            parts.append(np.arange(len(parts[0]), dtype=np.int64))
        if skip:
            cut = min(skip, len(parts[0]))
            parts, skip = [x[cut:] for x in parts], skip - cut
        bufs = [np.concatenate([b, x]) for b, x in zip(bufs, parts)]
        n_full = len(bufs[0]) // seq_len
        for i in range(n_full):
            lo = i * seq_len
            yield tuple(b[lo : lo + seq_len] for b in bufs)
        bufs = [b[n_full * seq_len :] for b in bufs]
