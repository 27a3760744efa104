"""Checkpoints of a store: a manifest plus hard links to the immutable files of a committed version.

Layout: ``<stripe dir>/checkpoints/<name>/`` in every stripe directory (hard links stay on their
filesystem), holding links to that stripe's files; stripe 0's directory also holds the manifest, the
stripe ID files and ``trainer.json`` (what resuming needs besides tensors: data position, RNG, …).

Crash safety: a checkpoint is built in ``<name>.partial`` directories and published by renaming
them, stripe 0 last; only a stripe-0 directory without ``.partial`` and with its manifest and
``trainer.json`` counts. Copy-free: taking one costs a link per file, whatever the model size.
Replacing one first publishes a link copy of the old one as ``<name>.replaced``, so at every instant
the old or the new checkpoint is complete somewhere. Checkpoints are ranked by training step
(``trainer.json``'s ``step``), not by store version: resuming an older one restarts the versions.
Checkpoints newer than the one a run resumes from are *set aside* into ``checkpoints/set-aside/``:
kept, never listed, never pruned.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time

import torch

from fuyou.errors import FuyouError, ManifestError, StoreError, exception_chain
from fuyou.storage.dirs import fsync_dir
from fuyou.storage.manifest import MANIFEST, read_manifest, write_manifest
from fuyou.storage.run_meta import STALE
from fuyou.storage.store import ID_FILE, TensorStore

CKPT = "checkpoints"
TRAINER = "trainer.json"
PARTIAL = ".partial"
REPLACED = ".replaced"
SET_ASIDE = "set-aside"
DAMAGE_ERRNOS = frozenset(
    {
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EIO,
        errno.EBADMSG,
        errno.ENODATA,
        getattr(errno, "EUCLEAN", errno.EIO),
    }
)
"""OS errors that mean a checkpoint's files are missing or corrupt; any other (EMFILE, ENOMEM, EACCES…)
says nothing about the checkpoint and is reported as itself (CheckpointAccessError)."""


class CheckpointAccessError(FuyouError):
    """A checkpoint could not be checked or listed for a reason that is not damage (EMFILE, ENOMEM,
    EACCES…): the operating system refused, the files may well be intact. Deliberately not a
    StoreError: callers that treat StoreError as "damaged, fall back to an older one" must not catch it."""


def _os_cause(e: BaseException) -> OSError | None:
    """The first OSError with an errno in ``e``'s chain (``e`` itself, then its causes/contexts)."""
    return next(
        (c for c in exception_chain(e, suppressed=False) if isinstance(c, OSError) and c.errno is not None), None
    )


def access_error(e: BaseException, what: str) -> CheckpointAccessError | None:
    """None if ``e`` means ``what`` (a checkpoint) is missing or corrupt; else the error naming the OS refusal.

    ``e`` is damage when no OSError is behind it (checksum, truncation, bad manifest) or when the
    OSError's errno is in DAMAGE_ERRNOS.
    """
    cause = _os_cause(e)
    if cause is None or cause.errno in DAMAGE_ERRNOS:
        return None
    code = str(cause.errno) if cause.errno is None else errno.errorcode.get(cause.errno, str(cause.errno))
    return CheckpointAccessError(
        f"cannot check {what}: the operating system refused ({code}: {cause.strerror or cause}) — this is not "
        f"damage, the checkpoint may be intact; fix the cause (e.g. raise the open-file limit with ulimit -n, "
        f"free memory, fix permissions) and run again"
    )


def _dirs(stripes: list[str], name: str, suffix: str = "") -> list[str]:
    return [os.path.join(d, CKPT, name + suffix) for d in stripes]


def take(store: TensorStore, name: str, trainer_state: dict, replace: bool = False) -> dict:
    """Checkpoint the store's last committed version as ``name``; return timing and size facts.

    ``trainer_state`` (JSON data; its ``step`` ranks the checkpoint) is saved with it. Raises
    StoreError if ``name`` exists, unless ``replace``: the old one is then linked to
    ``<name>.replaced`` first and removed only after the new one is published, so at every instant
    one of them is complete. Also raises StoreError if that version's host-RAM-tier extents are
    stale (``Engine.flush`` writes them back and commits a complete one).
    """
    t0 = time.perf_counter()
    final, partial = _dirs(store.dirs, name), _dirs(store.dirs, name, PARTIAL)
    if os.path.exists(final[0]) and not replace:
        raise StoreError(f"checkpoint {final[0]} exists already")
    body, files = store.committed()
    if body["meta"].get(STALE):
        raise StoreError(
            f"cannot checkpoint version {body['version']} of the store in {store.dirs[0]}: its host-RAM-tier "
            "extents were not written back; call Engine.flush() first"
        )
    _fresh_dirs(partial)
    for k, fname in files:
        os.link(os.path.join(store.dirs[k], fname), os.path.join(partial[k], fname))
    for k, d in enumerate(store.dirs):
        shutil.copy2(os.path.join(d, ID_FILE), partial[k])
    write_manifest(partial[0], body)
    write_manifest(partial[0], trainer_state, TRAINER)
    for p in partial:
        fsync_dir(p)
    if os.path.exists(final[0]):
        _replace(list(store.dirs), name)
    else:
        _publish(partial, final)
    return {"name": name, "version": body["version"], "files": len(files), "stall_s": time.perf_counter() - t0}


def _fresh_dirs(dirs: list[str]) -> None:
    """Empty directories at ``dirs`` (leftovers of an interrupted attempt are unpublished garbage)."""
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)


def _publish(partial: list[str], final: list[str]) -> None:
    """Rename built ``partial`` directories to ``final``, stripe 0 last: its rename publishes.

    ``final[0]`` must not exist; a ``final[k]`` (k ≥ 1) that does is an orphan of an unpublished
    attempt (its stripe 0 never appeared) and is removed.
    """
    for k in list(range(1, len(partial))) + [0]:
        if k and os.path.exists(final[k]):
            shutil.rmtree(final[k])
        os.rename(partial[k], final[k])
        fsync_dir(os.path.dirname(final[k]))


def _link_copy(src: list[str], dst: list[str]) -> None:
    """Fill empty directories ``dst`` with hard links to every file of ``src`` (per stripe), fsync'd."""
    for s, d in zip(src, dst):
        for fname in os.listdir(s):
            os.link(os.path.join(s, fname), os.path.join(d, fname))
        fsync_dir(d)


def _replace(stripes: list[str], name: str) -> None:
    """Publish the built ``<name>.partial`` over the published ``name``; the old or the new one is
    complete at every instant.

    1. link the old one to ``<name>.replaced`` (a complete, listed checkpoint; an earlier leftover
       of that name is set aside); 2. unpublish and remove the old ``name``; 3. publish the new one;
    4. remove ``<name>.replaced``. A crash in 2–3 leaves the old checkpoint as ``<name>.replaced``.
    """
    old, backup = _dirs(stripes, name), name + REPLACED
    if not all(os.path.isdir(d) for d in old):  # incomplete, so not a checkpoint to keep valid: keep its files
        set_aside(stripes, [name])
    else:
        if os.path.exists(_dirs(stripes, backup)[0]):
            set_aside(stripes, [backup])
        staging = _dirs(stripes, backup, PARTIAL)
        _fresh_dirs(staging)
        _link_copy(old, staging)
        _publish(staging, _dirs(stripes, backup))
        remove(stripes, name)
    _publish(_dirs(stripes, name, PARTIAL), _dirs(stripes, name))
    remove(stripes, backup)


def remove(stripes: list[str], name: str) -> None:
    """Delete checkpoint ``name``: unpublish it (rename stripe 0 to a ``.partial`` name), then delete.

    A crash midway leaves only ``.partial`` garbage (``prune`` removes it), never a half-deleted
    checkpoint that would look damaged.
    """
    final = _dirs(stripes, name)
    trash = _dirs(stripes, name, ".removing" + PARTIAL)
    if os.path.exists(final[0]):
        shutil.rmtree(trash[0], ignore_errors=True)
        os.rename(final[0], trash[0])
        fsync_dir(os.path.dirname(final[0]))
    for d in final[1:] + trash[:1]:
        shutil.rmtree(d, ignore_errors=True)


def _step_in(name: str) -> int:
    """The first integer in a checkpoint name (``step-00000012`` → 12), or -1."""
    m = re.search(r"\d+", name)
    return int(m.group()) if m else -1


def _rank(root: str, name: str) -> tuple[int, int, str] | None:
    """(training step, store version, name) of the published checkpoint ``root/name``; None if it is not one.

    The step is ``trainer.json``'s ``step`` (else the first number in the name). Raises
    CheckpointAccessError if reading it fails for a reason other than damage.
    """
    d = os.path.join(root, name)
    if name.endswith(PARTIAL) or name == SET_ASIDE or not os.path.isfile(os.path.join(d, TRAINER)):
        return None
    try:
        state, version = read_manifest(d, TRAINER), read_manifest(d)["version"]
    except (ManifestError, OSError) as e:
        err = access_error(e, f"checkpoint {d}")
        if err is not None:
            raise err from e
        return None
    step = state.get("step") if isinstance(state, dict) else None
    return (step if isinstance(step, int) else _step_in(name)), version, name


def list_checkpoints(stripes: list[str]) -> list[str]:
    """Published checkpoint names in ``stripes``, newest first: by training step, then store version.

    Set-aside, ``.partial`` and unreadable ones are not listed. Raises CheckpointAccessError if one
    cannot be read for a reason other than damage (too many open files, permissions…).
    """
    root = os.path.join(stripes[0], CKPT)
    if not os.path.isdir(root):
        return []
    found = [r for r in (_rank(root, n) for n in os.listdir(root)) if r is not None]
    return [n for *_, n in sorted(found, reverse=True)]


def unlisted(stripes: list[str]) -> list[str]:
    """Checkpoint directories in stripe 0 that are not listed: damaged beyond ranking (no readable
    ``trainer.json`` or manifest); ``.partial`` ones and the set-aside folder excluded."""
    root = os.path.join(stripes[0], CKPT)
    if not os.path.isdir(root):
        return []
    listed = set(list_checkpoints(stripes))
    return sorted(
        n
        for n in os.listdir(root)
        if n not in listed and n != SET_ASIDE and not n.endswith(PARTIAL) and os.path.isdir(os.path.join(root, n))
    )


def set_aside(stripes: list[str], names: list[str]) -> list[str]:
    """Move checkpoints ``names`` into ``checkpoints/set-aside/<name>.<UTC time>`` in every stripe; return
    the new names (relative to ``checkpoints/``).

    Set-aside checkpoints are kept (move one back to resume from it), never listed and never
    pruned, so later checkpoints may reuse their names. Stripes 1… move first and stripe 0 last: a
    crash midway leaves ``name`` listed but incomplete (damaged), never silently gone.
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    for name in names:
        rel = os.path.join(SET_ASIDE, _free_name(stripes, f"{name}.{stamp}"))
        for k in list(range(1, len(stripes))) + [0]:
            src, dst = os.path.join(stripes[k], CKPT, name), os.path.join(stripes[k], CKPT, rel)
            if os.path.exists(src):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.rename(src, dst)
                fsync_dir(os.path.dirname(dst))
                fsync_dir(os.path.dirname(src))
        moved.append(rel)
    return moved


def _free_name(stripes: list[str], base: str) -> str:
    """``base``, or ``base-1``, ``base-2``… : the first name free in every stripe's set-aside folder."""
    n, cand = 0, base
    while any(os.path.exists(os.path.join(d, CKPT, SET_ASIDE, cand)) for d in stripes):
        n += 1
        cand = f"{base}-{n}"
    return cand


def trainer_state(stripes: list[str], name: str) -> dict:
    """The ``trainer.json`` of checkpoint ``name`` (no data check); raises ManifestError if unreadable."""
    return read_manifest(_dirs(stripes, name)[0], TRAINER)


def validate(stripes: list[str], name: str, full: bool = True) -> dict:
    """Check checkpoint ``name``: manifest, every file present, and (``full``) every block's checksum.

    Returns its trainer state. Raises ManifestError/ChecksumError/StoreError naming the bad file when
    it is damaged (missing, truncated, corrupt), CheckpointAccessError when the check itself failed
    for another reason (too many open files, out of memory, permission denied…): that is no damage.
    """
    try:
        return _check(stripes, name, full)
    except (StoreError, OSError) as e:
        err = access_error(e, f"checkpoint {name} in {os.path.join(stripes[0], CKPT)}")
        if err is not None:
            raise err from e
        raise


def _check(stripes: list[str], name: str, full: bool) -> dict:
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


def prune(stripes: list[str], keep: int, protect: tuple[str, ...] = ()) -> list[str]:
    """Delete all but the ``keep`` newest checkpoints (by training step) and leftover ``.partial`` ones;
    return the deleted. Checkpoints named in ``protect`` (``--keep-best``'s) stay whatever their rank;
    set-aside checkpoints are never touched."""
    names = list_checkpoints(stripes)
    doomed = [n for n in names[keep:] if n not in protect]
    root = os.path.join(stripes[0], CKPT)
    partials = [n for n in os.listdir(root) if n.endswith(PARTIAL)] if os.path.isdir(root) else []
    for name in doomed:
        remove(stripes, name)
    for name in partials:
        for d in _dirs(stripes, name):
            shutil.rmtree(d, ignore_errors=True)
    return doomed + partials


def remove_all(stripes: list[str]) -> list[str]:
    """Delete every checkpoint in ``stripes``, set-aside ones included (``--overwrite``); return the
    deleted names. Each is unpublished before its files go (``remove``)."""
    root = os.path.join(stripes[0], CKPT)
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for name in names:
        if name.endswith(PARTIAL) or name == SET_ASIDE:
            for d in _dirs(stripes, name):
                shutil.rmtree(d, ignore_errors=True)
        else:
            remove(stripes, name)
    for d in stripes:  # stripes 1…: orphans whose stripe 0 is gone
        shutil.rmtree(os.path.join(d, CKPT), ignore_errors=True)
    return names


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
