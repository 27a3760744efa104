"""Packed sequences in a seeded per-epoch order, batched, resumable at an exact position.

Order: epoch ``e`` visits the records in ``numpy.random.default_rng([seed, e]).permutation``
order (or file order with ``shuffle=False``), re-reads each from its source (a JSONL line's byte offset, a table's row), tokenizes it and
packs the stream (see :mod:`fuyou.data.packing`). Shuffling is per record, so each epoch packs
differently. The sequence stream runs on across epochs; a batch is the next ``batch_size``
sequences. The position is ``(epoch, index)`` of the next sequence: a restored loader finds it
from the indexed token counts (one cumulative sum), tokenizes from that record on and skips the
tokens before it, so the continued stream is identical to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

import numpy as np
import torch

from fuyou.data.formats import DataError, validate_record
from fuyou.data.index import RecordIndex
from fuyou.data.packing import PACKINGS, locate, num_sequences, pack
from fuyou.data.tokenize import Encoder
from fuyou.errors import ConfigError

Batch = dict[str, torch.Tensor]
STATE_VERSION = 1


class PackedDataset:
    """Sequences of ``seq_len`` tokens packed from a subset of the indexed data (``packing``:
    ``concat`` or ``documents``, ``fuyou.data.packing``).

    Raises DataError at construction when the subset holds fewer tokens than one sequence.
    """

    def __init__(
        self,
        index: RecordIndex,
        encoder: Encoder,
        seq_len: int,
        records: np.ndarray | None = None,
        shuffle: bool = True,
        seed: int = 0,
        name: str | None = None,
        packing: str = "concat",
    ) -> None:
        if packing not in PACKINGS:
            raise ConfigError(f"--packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
        self.index, self.encoder, self.seq_len, self.packing = index, encoder, seq_len, packing
        self.records = (
            np.arange(index.n_records, dtype=np.int64) if records is None else np.asarray(records, dtype=np.int64)
        )
        self.shuffle, self.seed = shuffle, seed
        self.name = name or index.path
        self.n_tokens = int(index.lengths[self.records].sum(dtype=np.int64))
        self.sequences_per_epoch = num_sequences(self.n_tokens, seq_len)
        if self.sequences_per_epoch == 0:
            raise DataError(
                f"{self.name}: {self.n_tokens:,} tokens after tokenization "
                f"({len(self.records):,} records), but one sequence of --seq-len {seq_len:,} "
                f"needs {seq_len:,}; add data or lower --seq-len"
            )

    @property
    def fingerprint(self) -> str:
        """Identifies the data (every source, in order) and packing a resume state belongs to."""
        return (f"{self.index.fingerprint}:{len(self.records)}:{self.n_tokens}:{self.seq_len}:{int(self.shuffle)}") + (
            ":documents" if self.packing == "documents" else ""
        )

    def order(self, epoch: int) -> np.ndarray:
        """Record numbers in the order epoch ``epoch`` visits them (int64)."""
        if not self.shuffle:
            return self.records
        rng = np.random.default_rng([self.seed, epoch])
        return self.records[rng.permutation(len(self.records))]

    def sequences(self, epoch: int, start: int = 0) -> Iterator[tuple[np.ndarray, ...]]:
        """Yield epoch ``epoch``'s sequences from number ``start`` on: int64 ``[seq_len]`` (ids, labels)
        pairs, with ``documents`` packing (ids, labels, positions) triples."""
        if not 0 <= start < self.sequences_per_epoch:
            return
        order = self.order(epoch)
        pos, skip = locate(self.index.lengths[order], start * self.seq_len)
        docs = self._encoded(order[pos:])
        packed = pack(docs, self.seq_len, skip, documents=self.packing == "documents")
        yield from islice(packed, self.sequences_per_epoch - start)

    def _encoded(self, records: np.ndarray) -> Iterator[tuple[list[int], list[int]]]:
        """Re-read and tokenize ``records`` in order (each source opened when first needed); DataError if a
        source changed meanwhile."""
        idx = self.index
        with contextlib.ExitStack() as opened:
            readers: dict[int, Any] = {}
            for r in records:
                k, line = int(idx.source_ids[r]), int(idx.lines[r])
                if k not in readers:
                    readers[k] = opened.enter_context(idx.sources[k].open())
                name = idx.sources[k].name
                record = readers[k](int(idx.offsets[r]), line)
                validate_record(record, idx.fmt, name, line)
                ids, labels = self.encoder.encode(record, idx.fmt, name, line)
                if len(ids) != int(idx.lengths[r]):
                    raise DataError(f"{name}:{line}: record changed since it was indexed")
                yield ids, labels

    def batches_once(self, batch_size: int) -> Iterator[Batch]:
        """One pass over epoch 0 in batches of up to ``batch_size`` (the last may be smaller).

        Meant for held-out evaluation (build the dataset with ``shuffle=False``).
        """
        seqs = self.sequences(0)
        while chunk := list(islice(seqs, batch_size)):
            yield _to_batch(chunk)


def _to_batch(seqs: list[tuple[np.ndarray, ...]]) -> Batch:
    """Stack sequences into ``{"input_ids", "labels"}`` (and ``position_ids`` when packed by document)
    torch.long tensors of shape [B, T]."""
    keys = ("input_ids", "labels", "position_ids")
    return {k: torch.from_numpy(np.stack([s[i] for s in seqs])) for i, k in enumerate(keys[: len(seqs[0])])}


@dataclass(frozen=True)
class LoaderState:
    """Where a :class:`BatchLoader` is: JSON-serialisable through :meth:`to_dict`."""

    epoch: int
    """Epoch of the next sequence (0-based)."""
    index: int
    """Number of the next sequence within its epoch (0-based)."""
    step: int
    """Batches yielded so far over the whole run."""
    seed: int
    """Shuffling seed."""
    batch_size: int
    """Sequences per batch (micro-batch size x gradient accumulation)."""
    fingerprint: str
    """:attr:`PackedDataset.fingerprint` of the data the position refers to."""
    version: int = STATE_VERSION
    """Format version of this state."""

    def to_dict(self) -> dict[str, Any]:
        """The state as a small dict of ints and strings."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoaderState:
        """Rebuild a state from :meth:`to_dict` output; DataError if it is not one."""
        try:
            state = cls(**d)
        except TypeError as e:
            raise DataError(f"not a data-loader state: {e}") from None
        if state.version != STATE_VERSION:
            raise DataError(f"data-loader state version {state.version} is not {STATE_VERSION}")
        return state


class BatchLoader:
    """Endless, resumable stream of ``[batch_size, seq_len]`` batches over a dataset's epochs.

    Raises ConfigError at construction when ``batch_size < 1``.
    """

    def __init__(self, dataset: PackedDataset, batch_size: int) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch size (--micro-batch-size x --grad-accum) must be >= 1, got {batch_size}")
        self.dataset, self.batch_size = dataset, batch_size
        self.epoch = self.index = self.step = 0

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch yielded, as a JSON-serialisable dict."""
        return LoaderState(
            self.epoch, self.index, self.step, self.dataset.seed, self.batch_size, self.dataset.fingerprint
        ).to_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Continue from a state saved by :meth:`state_dict`.

        Raises DataError when it was saved for other data, seed, seq_len or batch size.
        """
        s = LoaderState.from_dict(d)
        mine = (self.dataset.seed, self.batch_size, self.dataset.fingerprint)
        if (s.seed, s.batch_size, s.fingerprint) != mine:
            raise DataError(
                f"cannot resume: the saved data position is for seed/batch/data {s.seed}, "
                f"{s.batch_size}, {s.fingerprint} but this run has {mine[0]}, {mine[1]}, {mine[2]}"
            )
        if not 0 <= s.index < self.dataset.sequences_per_epoch or s.epoch < 0 or s.step < 0:
            raise DataError(f"cannot resume: position epoch {s.epoch} index {s.index} is out of range")
        self.epoch, self.index, self.step = s.epoch, s.index, s.step

    def total_steps(self, steps: int | None = None, epochs: float | None = None) -> int:
        """Batches in the whole run: ``steps``, or ``epochs`` worth of sequences // batch size.

        Raises ConfigError unless exactly one of them is given and positive, and DataError when
        ``epochs`` of the data do not fill one batch.
        """
        if (steps is None) == (epochs is None):
            raise ConfigError("give exactly one of --steps and --epochs")
        if steps is not None:
            if steps < 1:
                raise ConfigError(f"--steps must be >= 1, got {steps}")
            return int(steps)
        assert epochs is not None
        if epochs <= 0:
            raise ConfigError(f"--epochs must be > 0, got {epochs}")
        n = self.dataset.sequences_per_epoch
        total = int(epochs * n) // self.batch_size
        if total == 0:
            raise DataError(
                f"{self.dataset.name}: {epochs:g} epoch(s) give {int(epochs * n):,} sequences of "
                f"{self.dataset.seq_len:,} tokens, fewer than one batch of {self.batch_size}; "
                "lower --micro-batch-size/--grad-accum/--seq-len or raise --epochs"
            )
        return total

    def _sequence_stream(self) -> Iterator[tuple[np.ndarray, ...]]:
        """Sequences from the current position on, across epoch boundaries, forever."""
        epoch, index = self.epoch, self.index
        while True:
            yield from self.dataset.sequences(epoch, index)
            epoch, index = epoch + 1, 0

    def batches(self, steps: int | None = None, epochs: float | None = None) -> Iterator[Batch]:
        """Yield batches until :meth:`total_steps` batches have been yielded in the whole run.

        A resumed loader yields only the remaining ones. The state is advanced before each
        batch is yielded, so :meth:`state_dict` taken after using batch ``k`` resumes at ``k+1``.
        """
        total = self.total_steps(steps, epochs)
        stream = self._sequence_stream()
        n = self.dataset.sequences_per_epoch
        while self.step < total:
            batch = _to_batch([next(stream) for _ in range(self.batch_size)])
            self.epoch, self.index = divmod(self.epoch * n + self.index + self.batch_size, n)
            self.step += 1
            yield batch

    @property
    def epoch_progress(self) -> float:
        """Epochs completed so far, fractional (for progress displays)."""
        return self.epoch + self.index / self.dataset.sequences_per_epoch
