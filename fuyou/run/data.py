"""Glue between ``fuyou finetune`` and ``fuyou.data``: the run's batches and held-out batches."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fuyou.errors import ConfigError, FuyouWarning
from fuyou.run.config import FinetuneConfig

EVAL_BATCHES = 8
"""Held-out batches evaluated at each evaluation (at most)."""


@dataclass
class RunData:
    """What the training loop needs from the data."""

    loader: Any
    eval_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    total_steps: int

    def train_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """(input_ids, labels, position_ids or None) per step, ``total_steps`` of them (positions with
        ``--packing documents``)."""
        for b in self.loader.batches(steps=self.total_steps):
            yield b["input_ids"], b["labels"], b.get("position_ids")


def packing_for(packing: str, config: Any) -> str:
    """``--packing`` for ``config``'s model: as given, but a model with linear-attention layers (Qwen3.5),
    whose recurrent state runs through a whole row and cannot be kept within a packed document, packs
    ``auto`` as ``concat`` (a FuyouWarning says so). Raises ConfigError for ``documents`` on such a model."""
    if "linear_attention" not in (getattr(config, "layer_types", None) or []):
        return packing
    if packing == "documents":
        raise ConfigError(
            "--packing documents cannot keep packed documents apart in this model's linear-attention layers "
            "(their state runs through the whole row); use --packing concat"
        )
    if packing == "auto":
        warnings.warn(
            "this model has linear-attention layers: --packing auto packs concat (documents share a row's "
            "state), not documents",
            FuyouWarning,
            stacklevel=2,
        )
        return "concat"
    return packing


def build_data(cfg: FinetuneConfig, tokenizer: Any, config: Any, world: int = 1) -> RunData:
    """Index the data (``--data``: files, globs, Parquet, ``datasets`` directories, hub dataset ids; or write the
    demo text), split off held-out data (or read ``--eval-data``), make the batch loader of
    global batches: ``micro_batch_size × grad_accum × world`` sequences, of which each of the
    ``world`` ranks trains its slice (every rank walks the same order, so a resumed loader state puts
    every rank at its exact position).

    Raises DataError / ConfigError (from ``fuyou.data``) for bad data or a too-long ``--seq-len``.
    """
    from fuyou.data import BatchLoader, build_datasets, write_demo_dataset

    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    packing = packing_for(cfg.packing, config)
    if cfg.data is None:
        train_path, eval_path = write_demo_dataset(os.path.join(cfg.output, "demo-data"), cfg.eval_fraction or 0.05)
        train, held = build_datasets(
            train_path,
            tokenizer,
            cfg.seq_len,
            data_format="text",
            seed=cfg.seed,
            max_positions=max_pos,
            eval_path=eval_path,
            packing=packing,
        )
    else:
        train, held = build_datasets(
            cfg.data,
            tokenizer,
            cfg.seq_len,
            data_format=cfg.data_format,
            seed=cfg.seed,
            max_positions=max_pos,
            eval_fraction=0.0 if cfg.eval_data else cfg.eval_fraction,
            eval_path=cfg.eval_data,
            packing=packing,
            columns=cfg.columns,
        )
    loader = BatchLoader(train, batch_size=cfg.micro_batch_size * cfg.grad_accum * world)
    total = loader.total_steps(steps=cfg.steps, epochs=cfg.epochs if cfg.steps is None else None)
    evals = []
    if held is not None:
        for i, b in enumerate(held.batches_once(cfg.micro_batch_size)):
            if i >= EVAL_BATCHES:
                break
            evals.append((b["input_ids"], b["labels"], b.get("position_ids")))
    return RunData(loader, evals, total)
