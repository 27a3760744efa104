"""Crash-safe, copy-free checkpoints (hard links to a committed store version) and exact resume."""

from fuyou.checkpoint.snapshot import list_checkpoints, prune, restore, take, validate

__all__ = ["list_checkpoints", "prune", "restore", "take", "validate"]
