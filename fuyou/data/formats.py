"""JSONL records: streaming reader, format detection and validation.

Three record formats are understood, one JSON object per line (blank lines are skipped):

* ``text``: ``{"text": str}``, every token trained;
* ``prompt_completion``: ``{"prompt": str, "completion": str}``, loss on the completion only;
* ``messages``: ``{"messages": [{"role": str, "content": str}, ...]}``, rendered with the
  tokenizer's chat template, loss on assistant turns only.

Extra keys are ignored. ``auto`` takes the format of the first record and requires every other
record to have the same one. Every problem is a :class:`DataError` whose one-line message names
the file and the 1-based line number.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, BinaryIO

from fuyou.errors import ConfigError, FuyouError

TEXT = "text"
PROMPT_COMPLETION = "prompt_completion"
MESSAGES = "messages"
FORMATS: tuple[str, ...] = (TEXT, PROMPT_COMPLETION, MESSAGES)
_BOM = b"\xef\xbb\xbf"


class DataError(FuyouError, ValueError):
    """The training data is missing, unreadable, malformed, inconsistent or too small."""


def check_format_name(data_format: str) -> str:
    """Return ``data_format`` if it is ``auto`` or one of :data:`FORMATS`.

    Raises ConfigError (naming ``--data-format``) for any other value.
    """
    if data_format != "auto" and data_format not in FORMATS:
        raise ConfigError(f"--data-format must be auto, {', '.join(FORMATS)}; got {data_format!r}")
    return data_format


def check_data_file(path: str | os.PathLike[str]) -> str:
    """Return ``path`` as a string if it names a readable regular file.

    Raises DataError when it does not exist, is a directory, or cannot be opened.
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise DataError(f"data file not found: {p}; pass an existing JSONL file with --data")
    if not os.path.isfile(p):
        raise DataError(f"data path is not a file: {p}; pass a JSONL file with --data")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise DataError(f"cannot open data file {p}: {e.strerror}") from None
    return p


def parse_line(raw: bytes, path: str, line_no: int) -> dict[str, Any] | None:
    """Decode one JSONL line into a dict; ``None`` for a blank line.

    Raises DataError (``path:line_no``) for invalid UTF-8, invalid JSON or a non-object value.
    """
    if line_no == 1 and raw.startswith(_BOM):
        raw = raw[len(_BOM) :]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{line_no}: not valid UTF-8 (byte {e.start}); save the file as UTF-8") from None
    text = text.rstrip("\r\n")
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{line_no}: malformed JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
        ) from None
    if not isinstance(record, dict):
        raise DataError(
            f'{path}:{line_no}: expected a JSON object, got {type(record).__name__}; write e.g. {{"text": "..."}}'
        )
    return record


def iter_records(path: str | os.PathLike[str]) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """Stream ``(line_no, byte_offset, record)`` for every non-blank line of a JSONL file.

    One line is in memory at a time. ``line_no`` is 1-based, ``byte_offset`` is where the line
    starts in the file (bytes), usable with :func:`read_record_at`. Raises DataError as
    :func:`check_data_file` and :func:`parse_line` do, lazily, when the bad line is reached.
    """
    p = check_data_file(path)
    offset = 0
    with open(p, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            record = parse_line(raw, p, line_no)
            if record is not None:
                yield line_no, offset, record
            offset += len(raw)


def read_record_at(f: BinaryIO, offset: int, path: str, line_no: int) -> dict[str, Any]:
    """Read the record whose line starts at ``offset`` (bytes) in the open binary file ``f``.

    Raises DataError if that line is no longer a JSON object (the file changed since indexing).
    """
    f.seek(offset)
    record = parse_line(f.readline(), path, line_no)
    if record is None:
        raise DataError(f"{path}:{line_no}: line is blank now; the data file changed during the run")
    return record


def detect_format(record: dict[str, Any], path: str, line_no: int) -> str:
    """Return the format a record is in: ``messages`` > ``prompt_completion`` > ``text`` by keys.

    Raises DataError (``path:line_no``) when the record has none of the expected keys.
    """
    if MESSAGES in record:
        return MESSAGES
    if "prompt" in record and "completion" in record:
        return PROMPT_COMPLETION
    if TEXT in record:
        return TEXT
    raise DataError(
        f"{path}:{line_no}: record has keys {sorted(record)}; expected 'text', 'prompt' + 'completion', or 'messages'"
    )


def _need_str(record: dict[str, Any], key: str, fmt: str, path: str, line_no: int) -> None:
    """Raise DataError unless ``record[key]`` exists and is a string."""
    if key not in record:
        raise DataError(f"{path}:{line_no}: the {fmt!r} format needs key {key!r}; record has keys {sorted(record)}")
    if not isinstance(record[key], str):
        raise DataError(f"{path}:{line_no}: {key!r} must be a string, got {type(record[key]).__name__}")


def _check_messages(messages: Any, path: str, line_no: int) -> None:
    """Raise DataError unless ``messages`` is a non-empty list of {role: str, content: str}."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{path}:{line_no}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(
                f"{path}:{line_no}: messages[{i}] must be an object with string 'role' and "
                f"string 'content', got {json.dumps(m)[:80]}"
            )


def validate_record(record: dict[str, Any], fmt: str, path: str, line_no: int) -> None:
    """Check that ``record`` carries the keys and types of format ``fmt``.

    Raises DataError (``path:line_no``) for a missing key or a value of the wrong type.
    """
    if fmt == TEXT:
        _need_str(record, TEXT, fmt, path, line_no)
    elif fmt == PROMPT_COMPLETION:
        _need_str(record, "prompt", fmt, path, line_no)
        _need_str(record, "completion", fmt, path, line_no)
    else:
        if MESSAGES not in record:
            raise DataError(
                f"{path}:{line_no}: the 'messages' format needs key 'messages'; record has keys {sorted(record)}"
            )
        _check_messages(record[MESSAGES], path, line_no)


def resolve_format(record: dict[str, Any], expected: str | None, auto: bool, path: str, line_no: int) -> str:
    """Return the format of ``record`` given the format ``expected`` so far (None before the first).

    With ``auto`` the record's format is detected and must equal ``expected`` once that is set;
    otherwise ``expected`` is the user's format. Raises DataError for a mixed file or a bad record.
    """
    if auto:
        fmt = detect_format(record, path, line_no)
        if expected is not None and fmt != expected:
            raise DataError(
                f"{path}:{line_no}: record is in the {fmt!r} format but earlier records are "
                f"{expected!r}; all records must share one format (or pass --data-format)"
            )
    else:
        assert expected is not None, "explicit format must be given"
        fmt = expected
    validate_record(record, fmt, path, line_no)
    return fmt
