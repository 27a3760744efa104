"""Every bad-input case: a FuyouError subclass with one clear line naming the file (and line)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fuyou.data.build import build_datasets
from fuyou.data.formats import DataError
from fuyou.errors import ConfigError, FuyouError
from tests.unit.data.helpers import tiny_tokenizer, write_jsonl

OK = {"text": "hello world"}
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}


def fails(exc: type[Exception], pattern: str, path: Any, tok: Any, seq_len: int = 2, **kw: Any) -> str:
    """Build datasets, expect ``exc`` matching ``pattern``; return the one-line message."""
    with pytest.raises(exc, match=pattern) as info:
        build_datasets(path, tok, seq_len, **kw)
    msg = str(info.value)
    assert isinstance(info.value, FuyouError) and "\n" not in msg
    return msg


def test_missing_file_and_directory(tmp_path: Path, tiny_tok: Any) -> None:
    fails(DataError, r"data file not found: .*nope\.jsonl", tmp_path / "nope.jsonl", tiny_tok)
    fails(DataError, r"data path is not a file", tmp_path, tiny_tok)


@pytest.mark.parametrize(
    "line, pattern",
    [
        ('{"text": "a"', r"bad\.jsonl:3: malformed JSON \(Expecting ',' delimiter at column 13\)"),
        ("[1, 2]", r"bad\.jsonl:3: expected a JSON object, got list"),
        ('{"txt": "a"}', r"bad\.jsonl:3: record has keys \['txt'\]; expected 'text'"),
        ('{"text": 5}', r"bad\.jsonl:3: 'text' must be a string, got int"),
        (
            '{"prompt": "a", "completion": "b"}',
            r"bad\.jsonl:3: record is in the 'prompt_completion' "
            r"format but earlier records are 'text'; all records must share one format",
        ),
    ],
)
def test_bad_line_reports_file_and_line(tmp_path: Path, tiny_tok: Any, line: str, pattern: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [OK, "", line, OK])  # line 2 blank: still counted
    fails(DataError, pattern, path, tiny_tok)


def test_invalid_utf8(tmp_path: Path, tiny_tok: Any) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    fails(DataError, r"bin\.jsonl:2: not valid UTF-8", path, tiny_tok)


@pytest.mark.parametrize(
    "fmt, row, pattern",
    [
        ("prompt_completion", {"prompt": "a"}, r"the 'prompt_completion' format needs key 'completion'"),
        ("prompt_completion", {"prompt": "a", "completion": None}, r"'completion' must be a string, got NoneType"),
        ("messages", {"text": "a"}, r"the 'messages' format needs key 'messages'"),
        ("messages", {"messages": []}, r"'messages' must be a non-empty list"),
        ("messages", {"messages": [{"role": "user"}]}, r"messages\[0\] must be an object with string 'role'"),
        ("text", CHAT, r"the 'text' format needs key 'text'"),
    ],
)
def test_explicit_format_mismatch(tmp_path: Path, tiny_tok: Any, fmt: str, row: dict[str, Any], pattern: str) -> None:
    path = write_jsonl(tmp_path / "f.jsonl", [row])
    fails(DataError, r"f\.jsonl:1: " + pattern, path, tiny_tok, data_format=fmt)


def test_unknown_format_name(tmp_path: Path, tiny_tok: Any) -> None:
    path = write_jsonl(tmp_path / "f.jsonl", [OK])
    fails(
        ConfigError,
        r"--data-format must be auto, text, prompt_completion, messages; got 'chat'",
        path,
        tiny_tok,
        data_format="chat",
    )


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path: Path, tiny_tok: Any, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    fails(DataError, r"empty\.jsonl: the data file has no records", path, tiny_tok)


def test_fewer_tokens_than_one_sequence(tmp_path: Path, tiny_tok: Any) -> None:
    path = write_jsonl(tmp_path / "small.jsonl", [OK, OK])  # 3 tokens each with EOS
    msg = fails(
        DataError,
        r"small\.jsonl: 6 tokens after tokenization \(2 records\), but one "
        r"sequence of --seq-len 64 needs 64; add data or lower --seq-len",
        path,
        tiny_tok,
        seq_len=64,
    )
    assert "6 tokens" in msg
    path = write_jsonl(tmp_path / "small.jsonl", [OK] * 3)
    fails(
        DataError,
        r"small\.jsonl \(held-out 0.34 split\): 3 tokens after tokenization "
        r"\(1 records\)",
        path,
        tiny_tok,
        seq_len=4,
        eval_fraction=0.34,
    )


def test_no_token_carries_loss(tmp_path: Path, tiny_tok: Any) -> None:
    path = write_jsonl(tmp_path / "u.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    fails(DataError, r"u\.jsonl: no token carries loss", path, tiny_tok)


def test_seq_len_above_model_maximum_and_invalid(tmp_path: Path, tiny_tok: Any) -> None:
    path = write_jsonl(tmp_path / "f.jsonl", [OK])
    fails(
        ConfigError,
        r"--seq-len 4,096 is above the model's maximum of 2,048 positions",
        path,
        tiny_tok,
        seq_len=4096,
        max_positions=2048,
    )
    fails(ConfigError, r"--seq-len must be a positive integer, got 0", path, tiny_tok, seq_len=0)
    fails(ConfigError, r"--seed must be a non-negative integer, got -1", path, tiny_tok, seed=-1)


def test_messages_without_chat_template(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    fails(
        DataError,
        r"chat\.jsonl: the 'messages' format needs a tokenizer with a chat template",
        path,
        tiny_tokenizer(chat_template=None),
    )


def test_bad_eval_fraction(tmp_path: Path, tiny_tok: Any) -> None:
    path = write_jsonl(tmp_path / "f.jsonl", [OK] * 3)
    fails(ConfigError, r"eval fraction must be in \[0, 1\)", path, tiny_tok, eval_fraction=1.0)
    fails(DataError, r"holding out 0.9 of 3 records leaves none", path, tiny_tok, eval_fraction=0.9)


def test_file_changed_after_indexing(tmp_path: Path, tiny_tok: Any) -> None:
    path = write_jsonl(tmp_path / "f.jsonl", [OK] * 4)
    train, _ = build_datasets(path, tiny_tok, 2)
    with open(path, "a") as f:
        f.write('{"text": "more"}\n')
    with pytest.raises(DataError, match="changed or vanished since it was indexed"):
        next(train.sequences(0))
    os.truncate(path, os.path.getsize(path) - 17)
    path.write_text(path.read_text().replace("hello world", "a b c d e f", 1))  # same size
    with pytest.raises(DataError, match="changed or vanished since it was indexed"):
        next(train.sequences(0))  # new modification time
    os.utime(path, ns=(train.index.sources[0].mtime_ns, train.index.sources[0].mtime_ns))
    with pytest.raises(DataError, match=r"f\.jsonl:\d: record changed since it was indexed"):
        list(train.sequences(0))
