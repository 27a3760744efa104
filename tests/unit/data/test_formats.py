"""Format detection (``auto``), validation and the line/offset bookkeeping of the reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fuyou.data.formats import iter_records
from fuyou.data.index import build_index
from fuyou.data.tokenize import Encoder
from tests.unit.data.helpers import write_jsonl

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}


@pytest.mark.parametrize(
    "row, fmt",
    [
        ({"text": "hello world", "id": 3}, "text"),  # extra keys are ignored
        ({"prompt": "what is", "completion": "four", "text": "x"}, "prompt_completion"),
        ({**CHAT, "text": "x"}, "messages"),
    ],
)
def test_auto_detects_format(tmp_path: Path, tiny_tok: Any, row: dict[str, Any], fmt: str) -> None:
    index = build_index(write_jsonl(tmp_path / "f.jsonl", [row, row]), Encoder(tiny_tok))
    assert index.fmt == fmt and index.n_records == 2


def test_explicit_format_overrides_detection(tmp_path: Path, tiny_tok: Any) -> None:
    row = {"prompt": "what is", "completion": "four", "text": "hello"}
    index = build_index(write_jsonl(tmp_path / "f.jsonl", [row]), Encoder(tiny_tok), "text")
    assert index.fmt == "text" and index.n_tokens == 2


def test_reader_offsets_lines_blank_lines_and_bom(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n\n   \n{"text": "b"}')  # BOM, CRLF, no final \n
    got = list(iter_records(path))
    assert got == [(1, 0, {"text": "a"}), (4, 23, {"text": "b"})]
    assert path.read_bytes()[23:] == b'{"text": "b"}'
