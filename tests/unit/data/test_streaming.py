"""Streaming: records are read lazily, and indexing memory does not grow with the text."""

from __future__ import annotations

import tracemalloc
import types
from pathlib import Path
from typing import Any

from fuyou.data.formats import iter_records
from fuyou.data.index import build_index
from fuyou.data.tokenize import Encoder
from tests.unit.data.helpers import WORDS


def test_reader_is_lazy(tmp_path: Path) -> None:
    path = tmp_path / "lazy.jsonl"
    path.write_text('{"text": "first"}\n\n' + "this is not json\n" * 1000)
    records = iter_records(path)
    assert isinstance(records, types.GeneratorType)
    assert next(records) == (1, 0, {"text": "first"})  # the bad lines have not been read yet


def test_index_memory_does_not_scale_with_text(tmp_path: Path, tiny_tok: Any) -> None:
    text = " ".join(WORDS * 4)  # ~1.1 kB, ~200 tokens a record
    line = f'{{"text": "{text}"}}\n'
    path = tmp_path / "big.jsonl"
    n = 3000  # ~3.4 MB of text, ~600k tokens
    path.write_text(line * n)
    enc = Encoder(tiny_tok)
    tracemalloc.start()
    try:
        index = build_index(path, enc)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.n_records == n and index.n_tokens == n * (len(WORDS) * 4 + 1)
    assert index.offsets[1] == len(line) and index.lines[-1] == n
    assert peak < 400_000, f"indexing {path.stat().st_size:,} bytes peaked at {peak:,} bytes"
