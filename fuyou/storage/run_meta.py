"""What a training store records about its run, in each committed version's manifest (``meta``): one
typed record, ``StoreMeta``, with its JSON form, and the one table of dtype names.

Written by the engine at every commit (``Engine.commit_meta``), read back by resume
(``fuyou.engine``), export (``fuyou.engine.export``), the run loop (``--precision auto`` on resume) and
the checkpoints (``STALE``). Keys at their default are left out of the JSON, so a store written before
a key existed reads back as that default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fuyou.errors import ConfigError, ManifestError

STALE = "ram_tier_stale"
"""Commit-metadata key: True when RAM-tier extents on SSD are older than the committed step (set by
``fuyou.transfer.ram_tier``; such a version must not be resumed from, exported or checkpointed)."""

PRECISIONS: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""``--precision`` names of a run's compute dtype."""
EXPORT_DTYPES: dict[str, torch.dtype] = {**PRECISIONS, "fp16": torch.float16}
"""``fuyou export --dtype`` names (``auto`` aside: the checkpoint's own)."""


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name as stores and extents record it (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def precision_name(dtype: torch.dtype) -> str:
    """The ``--precision`` name (``bf16``/``fp32``/``fp16``) of ``dtype``; raises ConfigError for another."""
    for name, d in EXPORT_DTYPES.items():
        if d == dtype:
            return name
    raise ConfigError(f"{dtype_name(dtype)} is not a training precision; expected one of {sorted(EXPORT_DTYPES)}")


_LEGACY_STATE = {"float32": "fp32", "bfloat16": "fp32-bf16"}
"""The optimizer-state format of a store from before formats were named, by its recorded moment dtype."""


def _legacy_state(meta: dict[str, Any]) -> str:
    """The format name of an older store's ``state_dtype`` (an unknown one passes through, to be refused)."""
    dtype = meta.get("state_dtype", "float32")
    return _LEGACY_STATE.get(dtype, dtype)


def _dtype(name: str) -> torch.dtype:
    from fuyou.storage.extents import dtype_from_name

    return dtype_from_name(name)


@dataclass(frozen=True)
class StoreMeta:
    """A committed version's record of its run: progress, and the layout facts resume and export need."""

    step: int
    """Updates applied."""
    lr: float
    """Learning rate of the last update."""
    compute_dtype: torch.dtype
    optimizer_state: str
    """The optimizer-state format's name (``fuyou.schedule.state_format``)."""
    state_chunk: int
    """Elements per optimizer-state chunk (the extents' shape: a resumed store keeps it)."""
    source_dtype: torch.dtype
    """The dtype of the checkpoint the run started from (what ``export --dtype auto`` writes)."""
    origin: bool = False
    """Whether the store keeps the source's exact values of frozen parameters (``ModelLayout.origin``)."""
    rank: int = 0
    world: int = 1
    lora_base: bool = False
    """A LoRA run's frozen base: no optimizer state, never written (JSON key ``frozen``)."""
    expert_groups: int = 1
    vocab_groups: int = 1
    freeze: tuple[str, ...] = ()
    """``--freeze`` patterns: their blocks have no optimizer state."""

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``meta`` (keys at their default left out)."""
        out: dict[str, Any] = {
            "step": self.step,
            "lr": self.lr,
            "compute_dtype": dtype_name(self.compute_dtype),
            "optimizer_state": self.optimizer_state,
            "state_chunk": self.state_chunk,
            "source_dtype": dtype_name(self.source_dtype),
        }
        return (
            out
            | ({"origin": True} if self.origin else {})
            | ({"rank": self.rank, "world": self.world} if self.world > 1 else {})
            | ({"frozen": True} if self.lora_base else {})
            | ({"expert_groups": self.expert_groups} if self.expert_groups > 1 else {})
            | ({"vocab_groups": self.vocab_groups} if self.vocab_groups > 1 else {})
            | ({"freeze": list(self.freeze)} if self.freeze else {})
        )

    @classmethod
    def from_json(cls, meta: dict[str, Any], where: str) -> StoreMeta:
        """The record of a manifest's ``meta`` read from the store in ``where``.

        Raises ManifestError if it is not a training store's (no layout recorded), ConfigError for a
        dtype name this version does not know."""
        if "compute_dtype" not in meta or "state_chunk" not in meta:
            raise ManifestError(
                f"{where} is not a Fuyou training store (no layout recorded); pass a run directory or the "
                "--ssd directories of a run"
            )
        compute = _dtype(meta["compute_dtype"])
        return cls(
            step=int(meta.get("step", 0)),
            lr=float(meta.get("lr", 0.0)),
            compute_dtype=compute,
            optimizer_state=meta.get("optimizer_state") or _legacy_state(meta),
            state_chunk=int(meta["state_chunk"]),
            source_dtype=_dtype(meta["source_dtype"]) if meta.get("source_dtype") else compute,
            origin=bool(meta.get("origin", False)),
            rank=int(meta.get("rank", 0)),
            world=int(meta.get("world", 1)),
            lora_base=bool(meta.get("frozen", False)),
            expert_groups=int(meta.get("expert_groups", 1)),
            vocab_groups=int(meta.get("vocab_groups", 1)),
            freeze=tuple(meta.get("freeze", ())),
        )
