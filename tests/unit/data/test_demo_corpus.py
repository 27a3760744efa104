"""The built-in demo dataset from ``pydoc_data.topics``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fuyou.data.build import build_datasets
from fuyou.data.demo_corpus import split_topics, write_demo_dataset


def read(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_demo_dataset_split_is_deterministic_and_about_five_percent(tmp_path: Path) -> None:
    from pydoc_data.topics import topics

    train_path, eval_path = write_demo_dataset(tmp_path / "a")
    again = write_demo_dataset(tmp_path / "b")
    assert Path(train_path).read_bytes() == Path(again[0]).read_bytes()
    assert Path(eval_path).read_bytes() == Path(again[1]).read_bytes()
    train, held = read(train_path), read(eval_path)
    assert len(train) + len(held) == len(topics) and not set(train) & set(held)
    share = sum(map(len, held)) / sum(map(len, topics.values()))
    assert 0.05 <= share < 0.075, share
    assert split_topics()[1] == sorted(split_topics()[1])


def test_demo_dataset_packs_with_smollm2(tmp_path: Path, smollm_tok: Any) -> None:
    train_path, eval_path = write_demo_dataset(tmp_path)
    train, held = build_datasets(train_path, smollm_tok, 512, eval_path=eval_path, max_positions=8192)
    assert held is not None and held.sequences_per_epoch >= 4
    assert train.sequences_per_epoch > 150  # ~100k tokens of Python documentation
