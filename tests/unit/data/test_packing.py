"""Packing exactness: every token once, in order, sequences of exactly seq_len, EOS between docs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fuyou.data.build import build_datasets
from fuyou.data.packing import locate, pack
from fuyou.data.tokenize import IGNORE_INDEX, Encoder
from tests.unit.data.helpers import WORDS, write_jsonl


def docs_of(lengths: list[int], start: int = 1000) -> list[tuple[list[int], list[int]]]:
    """Documents of distinct ids; labels = -id so ids and labels can be told apart."""
    out, nxt = [], start
    for n in lengths:
        ids = list(range(nxt, nxt + n))
        out.append((ids, [-i for i in ids]))
        nxt += n
    return out


@pytest.mark.parametrize("seq_len", [1, 3, 4, 7, 64])
def test_pack_every_token_once_in_order(seq_len: int) -> None:
    docs = docs_of([5, 1, 0, 9, 3, 12, 2])
    stream = [t for ids, _ in docs for t in ids]
    seqs = list(pack(iter(docs), seq_len))
    assert len(seqs) == len(stream) // seq_len
    assert all(a.shape == (seq_len,) and b.shape == (seq_len,) for a, b in seqs)
    assert all(a.dtype == np.int64 and b.dtype == np.int64 for a, b in seqs)
    flat = [int(t) for a, _ in seqs for t in a]
    assert flat == stream[: len(flat)]  # in order, no repeats, only the tail dropped
    assert all((b == -a).all() for a, b in seqs)  # labels travel with their ids


@pytest.mark.parametrize("skip", [0, 1, 5, 6, 13])
def test_pack_skip_matches_locate(skip: int) -> None:
    lengths = [5, 1, 0, 9, 3, 12, 2]
    docs = docs_of(lengths)
    stream = [t for ids, _ in docs for t in ids]
    pos, off = locate(np.array(lengths), skip)
    assert docs[pos][0][off] == stream[skip]
    flat = [int(t) for a, _ in pack(iter(docs[pos:]), 4, off) for t in a]
    assert flat == stream[skip : skip + len(flat)] and len(flat) == (len(stream) - skip) // 4 * 4


def test_locate_rejects_outside_stream() -> None:
    with pytest.raises(ValueError):
        locate(np.array([2, 3]), 5)


def test_text_file_packs_with_eos_between_documents(tmp_path: Path, tiny_tok: Any) -> None:
    texts = [" ".join(WORDS[i : i + 2 + i % 5]) for i in range(20)]
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    train, _ = build_datasets(path, tiny_tok, seq_len=8)
    assert train.packing == "concat"  # auto, for plain text
    enc = Encoder(tiny_tok)
    stream = [t for r in train.order(0) for t in enc.encode({"text": texts[r]}, "text")[0]]
    seqs = list(train.sequences(0))
    assert len(seqs) == train.sequences_per_epoch == len(stream) // 8
    assert [int(t) for a, _ in seqs for t in a] == stream[: len(seqs) * 8]
    assert all((a == b).all() for a, b in seqs)  # text: labels == ids everywhere
    assert sum(int((a == tiny_tok.eos_token_id).sum()) for a, _ in seqs) >= len(texts) - 2


def test_prompt_completion_labels_survive_packing(tmp_path: Path, tiny_tok: Any) -> None:
    rows = [{"prompt": "what is 2 + 2 ?", "completion": "it is 4"}] * 6
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    assert build_datasets(path, tiny_tok, seq_len=5)[0].packing == "documents"  # auto, for prompt/completion
    train, _ = build_datasets(path, tiny_tok, seq_len=5, packing="concat")
    ids = np.concatenate([a for a, _ in train.sequences(0)])
    labels = np.concatenate([b for _, b in train.sequences(0)])
    one_ids, one_labels = Encoder(tiny_tok).encode(rows[0], "prompt_completion")
    n = len(ids)
    assert ids.tolist() == (one_ids * 6)[:n] and labels.tolist() == (one_labels * 6)[:n]
    assert (labels[labels != IGNORE_INDEX] == ids[labels != IGNORE_INDEX]).all()


def test_documents_packing_restarts_positions_and_drops_each_documents_first_label():
    docs = [([1, 2, 3], [1, 2, 3]), ([4, 5, 6, 7, 8], [4, 5, 6, 7, 8]), ([9, 10], [-100, 10])]
    seqs = list(pack(iter(docs), 4, documents=True))
    ids = [int(t) for s in seqs for t in s[0]]
    labels = [int(t) for s in seqs for t in s[1]]
    pos = [int(t) for s in seqs for t in s[2]]
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8]  # the 2-token remainder is dropped, as with concat packing
    assert labels == [-100, 2, 3, -100, 5, 6, 7, 8]  # no document predicts the next one's first token
    assert pos == [0, 1, 2, 0, 1, 2, 3, 4]  # the document split across sequences keeps counting
    resumed = list(pack(iter(docs[1:]), 4, skip=1, documents=True))  # resume inside the second document
    assert [int(t) for t in resumed[0][2]] == [1, 2, 3, 4] and [int(t) for t in resumed[0][1]] == [5, 6, 7, 8]
