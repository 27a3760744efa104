"""Crash-safe, copy-free checkpoints (hard links to a committed store version) and exact resume."""

from fuyou.checkpoint.snapshot import (
    CheckpointAccessError,
    list_checkpoints,
    prune,
    remove,
    remove_all,
    restore,
    set_aside,
    take,
    trainer_state,
    validate,
)

__all__ = [
    "CheckpointAccessError",
    "list_checkpoints",
    "prune",
    "remove",
    "remove_all",
    "restore",
    "set_aside",
    "take",
    "trainer_state",
    "validate",
]
