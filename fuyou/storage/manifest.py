"""The store manifest: one small JSON file that says which files hold the current version.

It is replaced atomically (write a temp file, fsync, rename over, fsync the directory), so a crash
at any moment leaves either the old or the new manifest, never a mix. The manifest carries a CRC32C
of its own body so on-disk corruption of it is detected rather than misread.
"""

from __future__ import annotations

import json
import os

from fuyou.errors import ManifestError, os_limit_error
from fuyou.storage import checksum
from fuyou.storage.dirs import fsync_dir

MANIFEST = "manifest.json"
PREVIOUS = MANIFEST + ".previous"
"""The version before the current one, kept (with its files) while several ranks confirm a commit: a rank
that committed a step its peers did not can go back to it (``TensorStore.commit(agree=…)``)."""
FORMAT = 1


def _body_crc(body: dict) -> int:
    return checksum.crc(json.dumps(body, sort_keys=True).encode())


def write_manifest(directory: str, body: dict, name: str = MANIFEST) -> None:
    """Atomically replace ``directory/name`` with ``body`` (plus format and self-checksum)."""
    doc = {"format": FORMAT, "crc32c": _body_crc(body), "body": body}
    final = os.path.join(directory, name)
    tmp = f"{final}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(directory)


def read_manifest(directory: str, name: str = MANIFEST) -> dict:
    """Read and verify ``directory/name``; return its body.

    Raises ManifestError if it is missing, not valid JSON, of an unknown format, or fails its
    checksum; SystemLimitError if an OS limit (open files, memory) stops the read.
    """
    path = os.path.join(directory, name)
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ManifestError(f"no Fuyou store in {directory} ({name} is missing); create the store first") from None
    except (OSError, ValueError) as e:
        limit = os_limit_error(e, f"reading {path}")
        if limit is not None:
            raise limit from e
        raise ManifestError(f"{path} is unreadable ({e}); restore the run from a checkpoint") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "body" not in doc:
        raise ManifestError(f"{path} is not a Fuyou manifest of format {FORMAT}")
    if doc.get("crc32c") != _body_crc(doc["body"]):
        raise ManifestError(f"{path} fails its checksum (corrupted); restore the run from a checkpoint")
    return doc["body"]
