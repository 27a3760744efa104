"""What checkpoints cost on the SSD, and whether there is room for them.

A checkpoint is copy-free: hard links to the files of one committed store version. Linking costs
nothing, but once the live store moves on, the files only the checkpoint still links stay allocated:
each kept checkpoint pins at most one version of the state (the bytes a step rewrites: weights and
optimizer state of everything that trains). ``check_room`` refuses a run up front when its
``--ssd`` filesystem cannot hold the store's two versions plus one per kept checkpoint; ``space_note``
says, when a disk fills anyway, which checkpoints hold how much.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from fuyou.checkpoint.snapshot import CKPT, SET_ASIDE, list_checkpoints
from fuyou.errors import StoreSpaceError
from fuyou.storage.manifest import read_manifest
from fuyou.units import format_size

STORE_SUFFIX = ".fy"
"""The store's data files (``fuyou.storage``): the only files whose bytes count here."""


@dataclass(frozen=True)
class Pin:
    """What one checkpoint holds on the SSD beyond the live store: ``nbytes`` allocated in files that
    neither the live store nor any other checkpoint links; ``version``: the store version it pins."""

    name: str
    version: int | None
    nbytes: int


def _files(d: str) -> dict[tuple[int, int], int]:
    """The store files directly in ``d``: (device, inode) → allocated bytes."""
    out: dict[tuple[int, int], int] = {}
    if not os.path.isdir(d):
        return out
    for f in os.listdir(d):
        if f.endswith(STORE_SUFFIX):
            st = os.stat(os.path.join(d, f))
            out[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return out


def _checkpoint_dirs(stripes: list[str]) -> list[str]:
    """Every checkpoint's name relative to ``checkpoints/``: listed ones newest first, then set-aside ones."""
    aside = os.path.join(stripes[0], CKPT, SET_ASIDE)
    kept = sorted(os.listdir(aside)) if os.path.isdir(aside) else []
    return list_checkpoints(stripes) + [os.path.join(SET_ASIDE, n) for n in kept]


def pins(stripes: list[str]) -> list[Pin]:
    """Each checkpoint (listed newest first, then set-aside ones) with the bytes only it holds."""
    live: set[tuple[int, int]] = set()
    for d in stripes:
        live |= set(_files(d))
    held = {
        name: {k: v for d in stripes for k, v in _files(os.path.join(d, CKPT, name)).items()}
        for name in _checkpoint_dirs(stripes)
    }
    out = []
    for name, files in held.items():
        others = set().union(*(set(f) for n, f in held.items() if n != name))
        own = sum(b for k, b in files.items() if k not in live and k not in others)
        out.append(Pin(name, _version(os.path.join(stripes[0], CKPT, name)), own))
    return out


def _version(d: str) -> int | None:
    try:
        v = read_manifest(d).get("version")
    except Exception:  # noqa: BLE001 - a damaged checkpoint still holds its bytes
        return None
    return v if isinstance(v, int) else None


def space_note(stripes: list[str]) -> str:
    """One clause naming what the checkpoints hold beyond the live store, for a disk-full error."""
    held = [p for p in pins(stripes) if p.nbytes]
    if not held:
        return "no checkpoint holds space beyond the live store"
    total = sum(p.nbytes for p in held)
    each = ", ".join(
        f"{p.name} ({'version ' + str(p.version) + ', ' if p.version is not None else ''}{format_size(p.nbytes)})"
        for p in held
    )
    aside = any(p.name.startswith(SET_ASIDE) for p in held)
    return (
        f"{len(held)} checkpoint(s) pin {format_size(total)} the live store no longer uses: {each}; resume with "
        f"--resume auto --keep-checkpoints 1 to prune them before training"
        + (
            f"; set-aside ones are never pruned: delete those under {os.path.join(stripes[0], CKPT, SET_ASIDE)}"
            if aside
            else ""
        )
    )


def version_bytes(stripe: str, files: list[str]) -> int:
    """Allocated bytes of ``files`` (names in ``stripe``): one committed version's share of it."""
    total = 0
    for f in files:
        try:
            total += os.stat(os.path.join(stripe, f)).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


def check_room(stripes: list[str], files: list[tuple[int, str]], keep: int) -> None:
    """Refuse a run whose checkpoints will not fit: every stripe's filesystem needs room for the
    store's two versions plus one pinned version per kept checkpoint (``keep``), less what the stripe
    already holds. ``files``: the committed version's (stripe, name) (``TensorStore.committed``).

    Raises StoreSpaceError naming the stripe, what is needed and free, and the fixes.
    """
    for k, d in enumerate(stripes):
        v = version_bytes(d, [f for s, f in files if s == k])
        used = sum(_files(d).values()) + sum(p.nbytes for p in pins([d]))
        need = (keep + 2) * v - used
        usage = shutil.disk_usage(d)
        if usage.total and need > usage.free:
            raise StoreSpaceError(
                f"not enough room for checkpoints in {d}: the store's 2 versions plus {keep} kept checkpoint(s) "
                f"pin up to {keep + 2} × {format_size(v)}, {format_size(need)} more than is there, "
                f"{format_size(usage.free)} free; pass --keep-checkpoints {max(1, keep - 1)}"
                f"{'' if keep > 1 else ' or --save-every 0 (no checkpoints)'}, free space, or add another --ssd directory"
            )
