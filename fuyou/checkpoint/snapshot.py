"""Checkpoints of a store: a manifest plus hard links to the immutable files of a committed version.

Layout: ``<stripe dir>/checkpoints/<name>/`` in every stripe directory (hard links stay on their
filesystem), holding links to that stripe's files; stripe 0's directory also holds the manifest, the
stripe ID files and ``trainer.json`` (what resuming needs besides tensors: data position, RNG, …).

Crash safety: a checkpoint is built in ``<name>.partial`` directories and published by renaming
them, stripe 0 last; only a stripe-0 directory without ``.partial`` and with its manifest and
``trainer.json`` counts. Copy-free: taking one costs a link per file, whatever the model size.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch

from fuyou.engine.ram_tier import STALE
from fuyou.errors import ManifestError, StoreError
from fuyou.storage.dirs import fsync_dir
from fuyou.storage.manifest import MANIFEST, read_manifest, write_manifest
from fuyou.storage.store import ID_FILE, TensorStore

CKPT = "checkpoints"
TRAINER = "trainer.json"


def _dirs(stripes: list[str], name: str, suffix: str = "") -> list[str]:
    return [os.path.join(d, CKPT, name + suffix) for d in stripes]


def take(store: TensorStore, name: str, trainer_state: dict, replace: bool = False) -> dict:
    """Checkpoint the store's last committed version as ``name``; return timing and size facts.

    ``trainer_state`` (JSON data) is saved with it. Raises StoreError if ``name`` exists, unless
    ``replace`` (the old one stays valid until the new one is published), or if that version's
    host-RAM-tier extents are stale (``Engine.flush`` writes them back and commits a complete one).
    """
    t0 = time.perf_counter()
    final, partial = _dirs(store.dirs, name), _dirs(store.dirs, name, ".partial")
    if os.path.exists(final[0]) and not replace:
        raise StoreError(f"checkpoint {final[0]} exists already")
    body, files = store.committed()
    if body["meta"].get(STALE):
        raise StoreError(f"cannot checkpoint version {body['version']} of the store in {store.dirs[0]}: its host-RAM-tier "
                         "extents were not written back; call Engine.flush() first")
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
        os.makedirs(p)
    for k, fname in files:
        os.link(os.path.join(store.dirs[k], fname), os.path.join(partial[k], fname))
    for k, d in enumerate(store.dirs):
        shutil.copy2(os.path.join(d, ID_FILE), partial[k])
    write_manifest(partial[0], body)
    write_manifest(partial[0], trainer_state, TRAINER)
    for p in partial:
        fsync_dir(p)
    for k in list(range(1, len(partial))) + [0]:  # stripe 0 last: its rename publishes the checkpoint
        if os.path.exists(final[k]):
            shutil.rmtree(final[k])
        os.rename(partial[k], final[k])
        fsync_dir(os.path.dirname(final[k]))
    return {"name": name, "version": body["version"], "files": len(files), "stall_s": time.perf_counter() - t0}


def list_checkpoints(stripes: list[str]) -> list[str]:
    """Published checkpoint names in ``stripes``, newest (highest store version) first."""
    root = os.path.join(stripes[0], CKPT)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        d = os.path.join(root, name)
        if name.endswith(".partial") or not os.path.isfile(os.path.join(d, TRAINER)):
            continue
        try:
            found.append((read_manifest(d)["version"], name))
        except ManifestError:
            continue
    return [n for _, n in sorted(found, reverse=True)]


def validate(stripes: list[str], name: str, full: bool = True) -> dict:
    """Check checkpoint ``name``: manifest, every file present, and (``full``) every block's checksum.

    Returns its trainer state. Raises ManifestError/ChecksumError/StoreError naming the bad file.
    """
    dirs = _dirs(stripes, name)
    with TensorStore.open(dirs, direct="auto") as st:
        if st.meta.get(STALE):
            raise StoreError(f"checkpoint {name} holds stale host-RAM-tier extents (taken without a flush)")
        if full:
            biggest = max(e.nbytes for e in st.extents)
            buf = torch.empty(max(biggest, 1), dtype=torch.uint8)
            for e in st.extents:
                if st.committed()[0]["files"].get(e.name):
                    st.read(e.name, buf).result()
    return read_manifest(dirs[0], TRAINER)


def restore(stripes: list[str], name: str) -> dict:
    """Make checkpoint ``name`` the live store in ``stripes`` (by hard links); return its trainer state.

    The live store's files are replaced; the checkpoint itself stays intact (its files are linked,
    so later commits unlink rather than overwrite them).
    """
    src = _dirs(stripes, name)
    for k, d in enumerate(stripes):
        for fname in os.listdir(d):
            if fname.endswith(".fy") or fname.startswith(MANIFEST) or fname == ID_FILE:
                os.unlink(os.path.join(d, fname))
        for fname in os.listdir(src[k]):
            if fname.endswith(".fy"):
                os.link(os.path.join(src[k], fname), os.path.join(d, fname))
        shutil.copy2(os.path.join(src[k], ID_FILE), d)
        fsync_dir(d)
    write_manifest(stripes[0], read_manifest(src[0]))  # the atomic switch
    return read_manifest(src[0], TRAINER)


def prune(stripes: list[str], keep: int) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints (and leftover ``.partial`` ones); return the deleted."""
    names = list_checkpoints(stripes)
    doomed = names[keep:]
    root = os.path.join(stripes[0], CKPT)
    if os.path.isdir(root):
        doomed += [n for n in os.listdir(root) if n.endswith(".partial")]
    for name in doomed:
        for d in _dirs(stripes, name):
            shutil.rmtree(d, ignore_errors=True)
    return doomed


def disk_usage(stripes: list[str]) -> int:
    """Bytes allocated by the store and its checkpoints, each file counted once (hard links shared)."""
    seen, total = set(), 0
    for d in stripes:
        for root, _, files in os.walk(d):
            for f in files:
                st = os.stat(os.path.join(root, f))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def trainer_json(state: dict) -> str:
    """Canonical JSON of a trainer state (for comparisons in tests and logs)."""
    return json.dumps(state, sort_keys=True)
