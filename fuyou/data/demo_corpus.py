"""The built-in demo dataset: Python's own documentation, from the standard library.

``pydoc_data.topics.topics`` maps ~80 help topics to their text (~465k characters in Python 3.11;
the exact text differs between Python versions). Each topic becomes one ``{"text": ...}`` record.
"""

from __future__ import annotations

import json
import os
import zlib

from fuyou.errors import ConfigError


def _topics() -> dict[str, str]:
    """The standard library's help topics, name → text."""
    from pydoc_data.topics import topics

    return dict(topics)


def split_topics(eval_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """Deterministically split topic names into ``(train, held_out)``, both sorted.

    Topics are taken in the order of the CRC-32 of their names (stable across runs and
    platforms) into the held-out set until it holds at least ``eval_fraction`` of all characters,
    skipping any topic that would take it past 1.5 times that.
    Raises ConfigError unless ``0 < eval_fraction < 0.5``.
    """
    if not 0.0 < eval_fraction < 0.5:
        raise ConfigError(f"demo eval fraction must be in (0, 0.5), got {eval_fraction}")
    topics = _topics()
    total = sum(len(v) for v in topics.values())
    target = eval_fraction * total
    held, held_chars = [], 0
    for name in sorted(topics, key=lambda k: (zlib.crc32(k.encode()), k)):
        if held_chars >= target:
            break
        if held_chars + len(topics[name]) <= 1.5 * target:  # skip topics that overshoot
            held.append(name)
            held_chars += len(topics[name])
    train = sorted(set(topics) - set(held))
    return train, sorted(held)


def _write_jsonl(path: str, texts: list[str]) -> None:
    """Write ``{"text": ...}`` lines to ``path`` atomically (temporary file, then rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_demo_dataset(out_dir: str | os.PathLike[str], eval_fraction: float = 0.05) -> tuple[str, str]:
    """Write ``train.jsonl`` and ``eval.jsonl`` (one text record per help topic) into ``out_dir``.

    The held-out file gets about ``eval_fraction`` of the characters (see :func:`split_topics`).
    Returns the two paths. Raises ConfigError for a bad ``eval_fraction`` and OSError when
    ``out_dir`` cannot be created or written.
    """
    d = os.fspath(out_dir)
    os.makedirs(d, exist_ok=True)
    topics = _topics()
    train, held = split_topics(eval_fraction)
    train_path, eval_path = os.path.join(d, "train.jsonl"), os.path.join(d, "eval.jsonl")
    _write_jsonl(train_path, [topics[k] for k in train])
    _write_jsonl(eval_path, [topics[k] for k in held])
    return train_path, eval_path
