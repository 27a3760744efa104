"""A Hugging Face hub cache built on disk, laid out as ``huggingface_hub`` lays out its own (no network).

``<cache>/<models|datasets>--ORG--NAME/{blobs/<sha256>, snapshots/<commit>/<file> → ../../blobs/<sha256>,
refs/<revision>}``: what ``snapshot_download`` finds with ``HF_HUB_CACHE=<cache>`` and ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import hashlib
import os


def add_to_hub_cache(cache: str, repo_id: str, src: str, repo_type: str = "model", revision: str = "main") -> str:
    """Put every file under directory ``src`` into ``cache`` as repository ``repo_id`` at ``revision``;
    return the snapshot directory (its commit: the sha1 of the repo id and revision, 40 hex digits)."""
    folder = os.path.join(cache, f"{repo_type}s--{repo_id.replace('/', '--')}")
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snap = os.path.join(folder, "snapshots", commit)
    os.makedirs(os.path.join(folder, "blobs"), exist_ok=True)
    for root, _dirs, files in os.walk(src):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                data = f.read()
            blob = os.path.join(folder, "blobs", hashlib.sha256(data).hexdigest())
            with open(blob, "wb") as f:
                f.write(data)
            link = os.path.join(snap, os.path.relpath(path, src))
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
    with open(os.path.join(folder, "refs", revision), "w") as f:
        f.write(commit)
    return snap
