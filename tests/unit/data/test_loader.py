"""Seeded shuffling, exact resume, batch shapes, steps/epochs and the held-out split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fuyou.data.build import build_datasets
from fuyou.data.formats import DataError
from fuyou.data.loader import Batch, BatchLoader, PackedDataset
from fuyou.errors import ConfigError
from tests.unit.data.helpers import WORDS, write_jsonl

SEQ, BATCH = 6, 3


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    """40 text records of 1 to 12 words (~250 tokens: ~40 sequences of 6)."""
    rng = np.random.default_rng(1)
    rows = [{"text": " ".join(rng.choice(WORDS, size=int(rng.integers(1, 13))))} for _ in range(40)]
    return write_jsonl(tmp_path / "d.jsonl", rows)


def dataset(path: Path, tok: Any, seed: int = 0, **kw: Any) -> PackedDataset:
    return build_datasets(path, tok, SEQ, seed=seed, **kw)[0]


def run(loader: BatchLoader, steps: int) -> list[Batch]:
    return list(loader.batches(steps=steps))


def same(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"]) for x, y in zip(a, b)
    )


def test_batches_shape_dtype(data_file: Path, tiny_tok: Any) -> None:
    batches = run(BatchLoader(dataset(data_file, tiny_tok), BATCH), 4)
    assert len(batches) == 4
    for b in batches:
        assert set(b) == {"input_ids", "labels"}
        assert b["input_ids"].shape == b["labels"].shape == (BATCH, SEQ)
        assert b["input_ids"].dtype == b["labels"].dtype == torch.long


def test_same_seed_same_order_different_seed_different(data_file: Path, tiny_tok: Any) -> None:
    a = run(BatchLoader(dataset(data_file, tiny_tok, seed=7), BATCH), 30)
    b = run(BatchLoader(dataset(data_file, tiny_tok, seed=7), BATCH), 30)
    c = run(BatchLoader(dataset(data_file, tiny_tok, seed=8), BATCH), 30)
    assert same(a, b) and not same(a, c)
    ds = dataset(data_file, tiny_tok, seed=7)
    assert not np.array_equal(ds.order(0), ds.order(1))  # each epoch its own order
    assert sorted(ds.order(0)) == sorted(ds.order(1)) == list(range(40))


def test_each_epoch_covers_same_tokens(data_file: Path, tiny_tok: Any) -> None:
    ds = dataset(data_file, tiny_tok)
    counts = [np.bincount(np.concatenate([a for a, _ in ds.sequences(e)]), minlength=64) for e in range(2)]
    total = int(ds.index.lengths.sum())
    assert counts[0].sum() == counts[1].sum() == ds.sequences_per_epoch * SEQ > total - SEQ


@pytest.mark.parametrize("cut", [1, 13, 17, 35])
def test_resume_equals_uninterrupted(data_file: Path, tiny_tok: Any, cut: int) -> None:
    steps = 40  # 120 sequences: crosses two epoch boundaries
    full = run(BatchLoader(dataset(data_file, tiny_tok, seed=3), BATCH), steps)
    assert 2 * dataset(data_file, tiny_tok).sequences_per_epoch < steps * BATCH
    first = BatchLoader(dataset(data_file, tiny_tok, seed=3), BATCH)
    head = []
    for b in first.batches(steps=steps):
        head.append(b)
        if len(head) == cut:
            break
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["step"] == cut
    resumed = BatchLoader(dataset(data_file, tiny_tok, seed=3), BATCH)  # a fresh "process"
    resumed.load_state_dict(saved)
    assert same(head + run(resumed, steps), full)


def test_epochs_mode_and_state_positions(data_file: Path, tiny_tok: Any) -> None:
    ds = dataset(data_file, tiny_tok)
    loader = BatchLoader(ds, BATCH)
    n = ds.sequences_per_epoch
    assert loader.total_steps(epochs=2) == 2 * n // BATCH
    batches = list(loader.batches(epochs=2))
    assert len(batches) == 2 * n // BATCH
    s = loader.state_dict()
    assert s["epoch"] * n + s["index"] == len(batches) * BATCH and s["step"] == len(batches)
    assert loader.epoch_progress == pytest.approx(len(batches) * BATCH / n)


def test_total_steps_needs_one_of_steps_epochs(data_file: Path, tiny_tok: Any) -> None:
    loader = BatchLoader(dataset(data_file, tiny_tok), BATCH)
    for kw in ({}, {"steps": 3, "epochs": 1}, {"steps": 0}, {"epochs": -1}):
        with pytest.raises(ConfigError):
            loader.total_steps(**kw)
    with pytest.raises(DataError, match=r"fewer than one batch of 1000"):
        BatchLoader(dataset(data_file, tiny_tok), 1000).total_steps(epochs=1)
    with pytest.raises(ConfigError, match="batch size"):
        BatchLoader(dataset(data_file, tiny_tok), 0)


def test_resume_state_for_other_run_is_rejected(data_file: Path, tiny_tok: Any) -> None:
    loader = BatchLoader(dataset(data_file, tiny_tok, seed=1), BATCH)
    run(loader, 2)
    saved = loader.state_dict()
    with pytest.raises(DataError, match="cannot resume"):
        BatchLoader(dataset(data_file, tiny_tok, seed=2), BATCH).load_state_dict(saved)
    with pytest.raises(DataError, match="cannot resume"):
        BatchLoader(dataset(data_file, tiny_tok, seed=1), BATCH + 1).load_state_dict(saved)
    with pytest.raises(DataError, match="not a data-loader state"):
        loader.load_state_dict({"epoch": 0})


def test_held_out_fraction_is_disjoint_and_deterministic(data_file: Path, tiny_tok: Any) -> None:
    train, held = build_datasets(data_file, tiny_tok, SEQ, seed=5, eval_fraction=0.25)
    train2, held2 = build_datasets(data_file, tiny_tok, SEQ, seed=6, eval_fraction=0.25)
    assert held is not None and held2 is not None
    assert len(held.records) == 10 and len(train.records) == 30
    assert not set(held.records) & set(train.records)
    assert np.array_equal(held.records, held2.records)  # split independent of the training seed
    assert np.array_equal(held.order(3), held.records)  # never shuffled
    batches = list(held.batches_once(4))
    assert sum(b["input_ids"].shape[0] for b in batches) == held.sequences_per_epoch
    assert all(b["input_ids"].shape[1] == SEQ for b in batches)


def test_held_out_file(data_file: Path, tmp_path: Path, tiny_tok: Any) -> None:
    ev = write_jsonl(tmp_path / "ev.jsonl", [{"text": "hello world " * 5}])
    train, held = build_datasets(data_file, tiny_tok, SEQ, eval_path=ev)
    assert held is not None and held.sequences_per_epoch == 11 // SEQ
    with pytest.raises(ConfigError, match="not both"):
        build_datasets(data_file, tiny_tok, SEQ, eval_path=ev, eval_fraction=0.1)
