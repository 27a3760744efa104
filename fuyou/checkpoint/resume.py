"""What a run saves besides tensors, and how ``--resume auto|PATH`` picks a checkpoint."""

from __future__ import annotations

import base64
import io
import os
import warnings
from typing import Any

import torch

from fuyou.checkpoint.snapshot import CKPT, SET_ASIDE, list_checkpoints, set_aside, unlisted, validate
from fuyou.errors import ConfigError, FuyouWarning, StoreError


def encode_rng(state: Any) -> list[str]:
    """RNG state (a tensor or tuple of tensors from ``Backend.rng_state``) as base64 strings."""
    parts = state if isinstance(state, tuple) else (state,)
    out = []
    for t in parts:
        buf = io.BytesIO()
        torch.save(t, buf)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def decode_rng(parts: list[str]) -> Any:
    """Inverse of ``encode_rng``."""
    ts = tuple(torch.load(io.BytesIO(base64.b64decode(p)), weights_only=True) for p in parts)
    return ts[0] if len(ts) == 1 else ts


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after ``step`` completed steps."""
    return f"step-{step:08d}"


def resume_point(stripes: list[str], resume: str) -> tuple[str, dict] | None:
    """The checkpoint to resume from and its trainer state.

    ``auto``: the newest checkpoint (by training step) that passes a full check (manifest, files,
    every checksum); damaged ones are skipped with a warning naming the problem; None if there is
    none (fresh start). A path: that checkpoint (``…/checkpoints/<name>`` in the first --ssd
    directory), or ConfigError. Raises CheckpointAccessError (never "damaged") when a check fails
    for another reason (too many open files, out of memory, permission denied…). Moves nothing.
    """
    if resume == "auto":
        for name in list_checkpoints(stripes):
            try:
                return name, validate(stripes, name)
            except (StoreError, OSError) as e:
                warnings.warn(f"checkpoint {name} is damaged ({e}); trying an older one", FuyouWarning, stacklevel=2)
        return None
    path = os.path.abspath(resume)
    name = os.path.basename(path.rstrip("/"))
    expected = os.path.join(stripes[0], CKPT, name)
    if os.path.abspath(expected) != path:
        raise ConfigError(
            f"--resume {resume}: not a checkpoint of this run's store (expected under "
            f"{os.path.join(stripes[0], CKPT)}); pass one of {list_checkpoints(stripes) or 'none'}"
        )
    try:
        return name, validate(stripes, name)
    except (StoreError, OSError) as e:
        raise ConfigError(f"--resume {resume}: the checkpoint is damaged ({e}); use --resume auto to fall back") from e


def set_aside_newer(stripes: list[str], name: str | None) -> list[str]:
    """Set aside (never delete) the checkpoints a run resuming ``name`` would collide with; return them.

    Resuming checkpoint ``name``: every checkpoint ranked newer (by step; intact or damaged) and
    every unlisted (unreadable) checkpoint directory moves to ``checkpoints/set-aside/``, so the run
    can save those step names again. ``None`` (a fresh start after ``auto`` found none intact): all
    of them do. A FuyouWarning names what moved.
    """
    names = list_checkpoints(stripes)
    if name is None:
        newer = names
    else:
        newer = names[: names.index(name)] if name in names else []
    moved = set_aside(stripes, newer + unlisted(stripes))
    if moved:
        where = os.path.join(stripes[0], CKPT, SET_ASIDE)
        reason = f"newer than {name}, which this run resumes from" if name else "none of them is intact"
        warnings.warn(
            f"set aside {len(moved)} checkpoint(s) ({reason}) into {where}, kept, not deleted: "
            f"{', '.join(os.path.basename(m) for m in moved)}",
            FuyouWarning,
            stacklevel=2,
        )
    return moved


RANKS_MARKER = "ranks.json"
"""In rank 0's checkpoint of a multi-rank run: written once every rank has taken it (the checkpoint
counts only then)."""


def mark_all_ranks(stripes: list[str], name: str, world: int) -> None:
    """Rank 0, after every rank published checkpoint ``name``: record that all ``world`` ranks hold it
    (atomic, fsync'd)."""
    from fuyou.storage.manifest import write_manifest

    write_manifest(os.path.join(stripes[0], CKPT, name), {"world": world, "name": name}, RANKS_MARKER)


def all_ranks_hold(stripes: list[str], name: str, world: int) -> bool:
    """Whether rank 0's checkpoint ``name`` carries the marker that all ``world`` ranks took it."""
    from fuyou.errors import ManifestError
    from fuyou.storage.manifest import read_manifest

    try:
        body = read_manifest(os.path.join(stripes[0], CKPT, name), RANKS_MARKER)
    except (ManifestError, OSError):
        return False
    return isinstance(body, dict) and body.get("world") == world


def agreed_resume_point(stripes: list[str], resume: str, ranks: Any) -> tuple[str, dict] | None:
    """``resume_point`` for a run of several ranks (``fuyou.run.ranks.Ranks``; ``stripes``: this rank's):
    the newest checkpoint that rank 0 marked as held by all ranks and that every rank finds intact,
    the same on every rank. ``auto`` falls back through older marked ones (a damaged one warns) and
    returns None when none is agreed; a path names the checkpoint by its directory name and raises
    ConfigError unless every rank holds it intact and rank 0 marked it."""
    if ranks.world == 1:
        return resume_point(stripes, resume)
    named = None if resume == "auto" else os.path.basename(os.path.abspath(resume).rstrip("/"))
    offered = list_checkpoints(stripes) if ranks.root else []
    offered = [n for n in offered if (named is None or n == named) and all_ranks_hold(stripes, n, ranks.world)]
    for name in ranks.share(offered):
        state, why = None, ""
        try:
            state = validate(stripes, name)
        except (StoreError, OSError) as e:
            why = str(e)
        if ranks.all_ok(state is not None):
            return name, state  # type: ignore[return-value]
        if why:
            warnings.warn(f"checkpoint {name} is damaged ({why}); trying an older one", FuyouWarning, stacklevel=2)
    if named is not None:
        raise ConfigError(
            f"--resume {resume}: not a checkpoint every rank holds intact (rank 0 marks those); use --resume auto"
        )
    return None
