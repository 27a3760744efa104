"""The SSD tensor store: extents of tensors in versioned, checksummed, striped files.

Crash safety: a write never touches a committed file. The first write of an extent after a commit
goes to a new file (a recycled retired one, or a fresh preallocated one); ``commit`` waits for all
writes, fsyncs them, and atomically replaces the manifest, which is the only thing that says which
files are current. Files the new manifest no longer names are retired: kept as spares for the next
write, or unlinked if a checkpoint hard-linked them (their data lives on through the link).

Several ranks (data parallel) commit with ``agree``: the previous version's manifest and files are kept
until every rank has written its new manifest, so a crash of any rank at any moment leaves every rank's
store at the step the slowest one reached, or one step ahead of it with that step still on disk
(``previous``, ``roll_back``).

Reads see the latest write ("read your writes"), committed or not, so the next step's forward can
read weights Adam wrote before the step is committed. A read of an extent waits for that extent's
write in flight; a write must not overlap a read of the same extent (the I/O backend orders them).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fuyou.errors import ConfigError, ManifestError, StoreDirError, StoreError
from fuyou.storage import checksum, dirs as fsdirs
from fuyou.storage.extents import ExtentSpec, Piece, place
from fuyou.storage.io_base import FileHandle, gather, then
from fuyou.storage.io_select import make_io
from fuyou.storage.manifest import MANIFEST, PREVIOUS, read_manifest, write_manifest

ID_FILE = "fuyou-store.id"


@dataclass(eq=False)
class _File:
    """One piece's file: where it is, its open handle, and the block CRCs of its data."""

    dir_index: int
    name: str
    handle: FileHandle
    crcs: list[int] | None = None


@dataclass(eq=False)
class _Extent:
    index: int
    spec: ExtentSpec
    pieces: tuple[Piece, ...]
    committed: list[_File] | None = None
    pending: list[_File] | None = None
    write_future: Future | None = None
    spares: list[list[_File]] = field(default_factory=list)


def stage_of_extent(name: str) -> str:
    """What extent ``name`` holds, for CPU accounting (``cpu_meter``): ``weights`` (``w/…``), ``state``
    (``s/…``) or ``other``."""
    return {"w": "weights", "s": "state"}.get(name.split("/", 1)[0], "other")


def as_bytes(buf: torch.Tensor | np.ndarray, nbytes: int, what: str) -> np.ndarray:
    """A uint8 numpy view of the first ``nbytes`` bytes of a contiguous CPU buffer.

    Raises ConfigError if ``buf`` is not a contiguous CPU tensor/array or is too small.
    """
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ConfigError(f"{what}: the buffer must be a contiguous CPU tensor")
        arr = buf.reshape(-1).view(torch.uint8).numpy()
    elif isinstance(buf, np.ndarray) and buf.flags.c_contiguous:
        arr = buf.reshape(-1).view(np.uint8)
    else:
        raise ConfigError(f"{what}: expected a contiguous torch tensor or numpy array, got {type(buf).__name__}")
    if arr.size < nbytes:
        raise ConfigError(f"{what}: buffer holds {arr.size} bytes, the extent needs {nbytes}")
    return arr[:nbytes]


class TensorStore:
    """Versioned extents striped over directories; create with ``create``, reopen with ``open``."""

    def __init__(
        self,
        dirs: list[str],
        extents: list[ExtentSpec],
        pieces: list[tuple[Piece, ...]],
        body: dict,
        *,
        io: str,
        direct: str,
        checksums: bool,
        threads: int,
        fsync: bool,
    ) -> None:
        self.dirs = dirs
        self.store_id: str = body["store_id"]
        self.block_bytes: int = body["block_bytes"]
        self.stripe_min: int = body["stripe_min"]
        self.version: int = body["version"]
        self.meta: dict = body.get("meta", {})
        self.checksums = checksums
        self.fsync = fsync
        self.direct = [fsdirs.resolve_direct(direct, d) for d in dirs]
        self.io = make_io(io, threads, self.block_bytes)
        self._ext = {e.name: _Extent(i, e, p) for i, (e, p) in enumerate(zip(extents, pieces))}
        self._lock = threading.RLock()
        self._closed = False
        self.previous: dict | None = None
        """The manifest body of the version before the current one while it is kept on disk (a commit
        with ``agree`` that not every rank confirmed), else None; see ``roll_back``."""
        self._held: list[list[_File]] = []

    # ---------------------------------------------------------------- create / open
    @classmethod
    def create(
        cls,
        dirs: list[str],
        extents: list[ExtentSpec],
        *,
        io: str = "auto",
        direct: str = "auto",
        checksums: bool = True,
        threads: int = 16,
        block_bytes: int = 1 << 20,
        stripe_min: int = 4 << 20,
        fsync: bool = True,
        overwrite: bool = False,
    ) -> TensorStore:
        """Make a new, empty store for ``extents`` striped over ``dirs`` (one per SSD).

        Checks up front that each directory exists, is writable and has room for two versions of
        its share (current + next, for crash-safe commits). Raises StoreDirError if a directory
        already holds a store (unless ``overwrite``), StoreSpaceError if space is short.
        """
        if not dirs:
            raise ConfigError("at least one SSD directory is needed (--ssd DIR)")
        if len({e.name for e in extents}) != len(extents):
            raise ConfigError("extent names must be unique")
        dirs = [fsdirs.check_dir(d) for d in dirs]
        if len(set(dirs)) != len(dirs):
            raise ConfigError(f"the same SSD directory is given twice: {dirs}")
        for d in dirs:
            if os.path.exists(os.path.join(d, ID_FILE)) or os.path.exists(os.path.join(d, MANIFEST)):
                if not overwrite:
                    raise StoreDirError(f"{d} already holds a Fuyou store; open it, or pass overwrite to replace it")
                _remove_store_files(d)
        pieces = place(extents, len(dirs), stripe_min)
        for k, d in enumerate(dirs):
            share = sum(p.file_bytes for ps in pieces for p in ps if p.dir_index == k)
            fsdirs.check_space(d, 2 * share + (1 << 20), "the store (2 versions of its share, for crash-safe commits)")
        body = {
            "store_id": uuid.uuid4().hex,
            "version": 0,
            "block_bytes": block_bytes,
            "ndirs": len(dirs),
            "stripe_min": stripe_min,
            "extents": [e.to_json() for e in extents],
            "files": {},
            "meta": {},
        }
        for k, d in enumerate(dirs):
            write_manifest(d, {"store_id": body["store_id"], "index": k}, ID_FILE)
        write_manifest(dirs[0], body)
        return cls(dirs, extents, pieces, body, io=io, direct=direct, checksums=checksums, threads=threads, fsync=fsync)

    @staticmethod
    def discard(dirs: list[str]) -> None:
        """Remove a store's files (data, manifests, id) from ``dirs``, leaving every other file; for a
        store just created whose first version never committed (a failed import)."""
        for d in dirs:
            _remove_store_files(d)

    @classmethod
    def open(
        cls,
        dirs: list[str],
        *,
        io: str = "auto",
        direct: str = "auto",
        checksums: bool = True,
        threads: int = 16,
        fsync: bool = True,
    ) -> TensorStore:
        """Open an existing store at its last committed version; uncommitted files are discarded.

        Raises ManifestError if there is no valid manifest, StoreDirError if the directories are not
        this store's stripes in creation order, ChecksumError/StoreError if a named file is missing.
        """
        dirs = [fsdirs.check_dir(d) for d in dirs]
        idents = [read_manifest(d, ID_FILE) if os.path.exists(os.path.join(d, ID_FILE)) else {} for d in dirs]
        if idents[0].get("index", 0) != 0:
            raise StoreDirError(
                f"{dirs[0]} is stripe {idents[0]['index']} of a store, not its first; "
                "pass the --ssd directories in creation order"
            )
        body = read_manifest(dirs[0])
        if body["ndirs"] != len(dirs):
            raise StoreDirError(
                f"the store in {dirs[0]} is striped over {body['ndirs']} directories, {len(dirs)} given"
            )
        for k, (d, ident) in enumerate(zip(dirs, idents)):
            if ident.get("store_id") != body["store_id"] or ident.get("index") != k:
                raise StoreDirError(
                    f"{d} is not stripe {k} of the store in {dirs[0]}; pass the --ssd directories in creation order"
                )
        extents = [ExtentSpec.from_json(e) for e in body["extents"]]
        pieces = place(extents, len(dirs), body["stripe_min"])
        store = cls(
            dirs, extents, pieces, body, io=io, direct=direct, checksums=checksums, threads=threads, fsync=fsync
        )
        store.previous = _previous_of(dirs, body)
        store._load_files(body["files"], store.previous["files"] if store.previous else {})
        return store

    def _load_files(self, files: dict, keep: dict) -> None:
        """Open the files of ``files`` (a manifest's) as the committed version; delete every other store
        file except those ``keep`` names (the kept previous version)."""
        named: set[tuple[int, str]] = {(d, fname) for entry in keep.values() for d, fname, _ in entry}
        for name, entry in files.items():
            ext = self._ext[name]
            recs = []
            for d, fname, crcs in entry:
                path = os.path.join(self.dirs[d], fname)
                if not os.path.exists(path):
                    raise ManifestError(f"{path} named by the manifest is missing; restore the run from a checkpoint")
                recs.append(_File(d, fname, self._open(path, d, ext), checksum.decode(crcs)))
                named.add((d, fname))
            ext.committed = recs
        for k, d in enumerate(self.dirs):  # files of uncommitted writes (a crash mid-step) are garbage
            for fname in os.listdir(d):
                stale_tmp = fname.startswith(MANIFEST + ".tmp-")
                if stale_tmp or (fname.endswith(".fy") and (k, fname) not in named):
                    os.unlink(os.path.join(d, fname))

    def _open(self, path: str, dir_index: int, ext: _Extent) -> FileHandle:
        """A handle on ``path`` (in directory ``dir_index``) holding a piece of ``ext``, tagged with the
        extent's stage for CPU accounting (``stage_of_extent``)."""
        h = self.io.open(path, self.direct[dir_index])
        h.stage = stage_of_extent(ext.spec.name)
        return h

    # ---------------------------------------------------------------- data path
    @property
    def extents(self) -> list[ExtentSpec]:
        """The extents in layout order."""
        return [e.spec for e in self._ext.values()]

    def spec(self, name: str) -> ExtentSpec:
        """The layout of extent ``name``; raises ConfigError if unknown."""
        return self._get(name).spec

    def _get(self, name: str) -> _Extent:
        if self._closed:
            raise StoreError("the store is closed")
        try:
            return self._ext[name]
        except KeyError:
            raise ConfigError(f"no extent {name!r} in this store") from None

    def write(self, name: str, buf: torch.Tensor | np.ndarray) -> Future:
        """Start writing extent ``name`` from ``buf``; returns a future (None, or the I/O error).

        The data becomes readable at once (``read`` waits for it) and durable at ``commit``.
        ``buf`` must not change until the future completes. Raises StoreSpaceError at once if a new
        file cannot be allocated.
        """
        ext = self._get(name)
        arr = as_bytes(buf, ext.spec.nbytes, f"write of extent {name!r}")
        with self._lock:
            prev = ext.write_future
            if ext.pending is None:
                ext.pending = self._new_files(ext)
            files = ext.pending
        if prev is not None:
            prev.exception()  # write-after-write on one extent: keep them in order
        futs = [
            self.io.write(f.handle, arr[p.start : p.start + p.length], self.checksums)
            for f, p in zip(files, ext.pieces)
        ]

        def record(crcs: list[list[int]]) -> None:
            for f, c in zip(files, crcs):
                f.crcs = c

        fut = then(gather(futs), record)
        with self._lock:
            ext.write_future = fut
        return fut

    def _new_files(self, ext: _Extent) -> list[_File]:
        gen = self.version + 1
        if ext.spares:
            files = ext.spares.pop()
            for f, p in zip(files, ext.pieces):
                new = f"{ext.index:06d}.{p.dir_index}.{gen}.fy"
                os.rename(os.path.join(self.dirs[f.dir_index], f.name), os.path.join(self.dirs[f.dir_index], new))
                f.name, f.crcs = new, None
                f.handle.path = os.path.join(self.dirs[f.dir_index], new)
            return files
        files = []
        try:
            for p in ext.pieces:
                path = os.path.join(self.dirs[p.dir_index], f"{ext.index:06d}.{p.dir_index}.{gen}.fy")
                fsdirs.preallocate(path, p.file_bytes)
                files.append(_File(p.dir_index, os.path.basename(path), self._open(path, p.dir_index, ext)))
        except BaseException:
            self._drop(files)
            raise
        return files

    def read(self, name: str, buf: torch.Tensor | np.ndarray) -> Future:
        """Start reading the latest data of extent ``name`` into ``buf``; returns a future.

        The future fails with ChecksumError (naming file, byte range and extent) on corruption.
        Raises StoreError at once if the extent was never written.
        """
        ext = self._get(name)
        arr = as_bytes(buf, ext.spec.nbytes, f"read of extent {name!r}")
        with self._lock:
            wf = ext.write_future
        if wf is not None:
            wf.result()  # read your writes: the write in flight must land first
        with self._lock:
            files = ext.pending if ext.pending is not None else ext.committed
        if files is None:
            raise StoreError(f"extent {name!r} has never been written")
        futs = [
            self.io.read(
                f.handle,
                arr[p.start : p.start + p.length],
                f.crcs if self.checksums else None,
                f"extent {name!r}, piece {k}",
                compute=False,
            )
            for k, (f, p) in enumerate(zip(files, ext.pieces))
        ]
        return then(gather(futs), lambda _: None)

    # ---------------------------------------------------------------- versions
    def commit(self, meta: dict | None = None, agree: Callable[[int], object] | None = None) -> int:
        """Make every write since the last commit durable and current, atomically; return the version.

        Waits for the writes (raising StoreError if any failed — the previous version stays
        current), fsyncs data and directories, then replaces the manifest. ``meta`` (JSON data,
        e.g. the training step) is stored with the version.

        ``agree`` (several ranks): called with the new version once its manifest is written; it returns
        when every rank has written its own (a collective). Until then the previous version stays on
        disk with its manifest (``PREVIOUS``), so a rank whose peers died before committing can go back
        to the step they hold. Whatever ``agree`` raises propagates, the previous version kept.
        """
        self.forget_previous()
        with self._lock:
            dirty = [e for e in self._ext.values() if e.pending is not None]
            futs = [e.write_future for e in dirty if e.write_future is not None]
        wait(futs)
        errors = [f.exception() for f in futs if f.exception() is not None]
        if errors:
            raise StoreError(
                f"commit of version {self.version + 1} failed, version {self.version} stays current: {errors[0]}"
            )
        if self.fsync:
            written = [f for e in dirty if e.pending is not None for f in e.pending]
            gather([self.io.fsync(f.handle) for f in written]).result()
            for d in {f.dir_index for f in written}:
                fsdirs.fsync_dir(self.dirs[d])
        before = self.committed()[0] if agree is not None else None
        with self._lock:
            body = self._body(self.version + 1, meta if meta is not None else self.meta)
            if before is not None:
                write_manifest(self.dirs[0], before, PREVIOUS)
            write_manifest(self.dirs[0], body)
            old = [(e, e.committed) for e in dirty]
            for e in dirty:
                e.committed, e.pending, e.write_future = e.pending, None, None
            self.version, self.meta = body["version"], body["meta"]
            self._held = [files for _, files in old if files is not None]
        if agree is not None:
            agree(self.version)
            os.unlink(os.path.join(self.dirs[0], PREVIOUS))  # every rank holds the new version
        with self._lock:
            self._held = []
            for e, files in old:
                self._retire(e, files)
        return self.version

    def _body(self, version: int, meta: dict) -> dict:
        files = {}
        for name, e in self._ext.items():
            cur = e.pending if e.pending is not None else e.committed
            if cur is not None:
                files[name] = [[f.dir_index, f.name, checksum.encode(f.crcs or [])] for f in cur]
        return {
            "store_id": self.store_id,
            "version": version,
            "block_bytes": self.block_bytes,
            "ndirs": len(self.dirs),
            "stripe_min": self.stripe_min,
            "extents": [e.spec.to_json() for e in self._ext.values()],
            "files": files,
            "meta": meta,
        }

    def committed(self) -> tuple[dict, list[tuple[int, str]]]:
        """The manifest body of the last committed version and the files it names: (stripe, name).

        Those files are immutable until a later commit retires them; one that has been hard-linked
        elsewhere (a checkpoint) is then unlinked, never recycled, so the link keeps its data.
        """
        with self._lock:
            files: dict[str, list[list[Any]]] = {
                n: [[f.dir_index, f.name, checksum.encode(f.crcs or [])] for f in e.committed]
                for n, e in self._ext.items()
                if e.committed is not None
            }
            body = {
                "store_id": self.store_id,
                "version": self.version,
                "block_bytes": self.block_bytes,
                "ndirs": len(self.dirs),
                "stripe_min": self.stripe_min,
                "extents": [e.spec.to_json() for e in self._ext.values()],
                "files": files,
                "meta": self.meta,
            }
            return body, [(d, name) for entry in files.values() for d, name, _ in entry]

    def _retire(self, e: _Extent, old: list[_File] | None) -> None:
        """``old``, files of ``e`` no version names any more: spares, or unlinked if a checkpoint links them."""
        if old is None:
            return
        if any(self._linked(f) for f in old):
            self._drop(old)  # a checkpoint links these files: unlink our name only
        else:
            e.spares.append(old)

    def _linked(self, f: _File) -> bool:
        """True if ``f``'s data has another name (a checkpoint's hard link), so it must never be
        overwritten. Decided from the file itself (its link count), whatever the I/O backend's handles
        are. Raises OSError if the file is gone."""
        return os.stat(os.path.join(self.dirs[f.dir_index], f.name)).st_nlink > 1

    def _drop(self, files: list[_File]) -> None:
        for f in files:
            self.io.close(f.handle)
            os.unlink(os.path.join(self.dirs[f.dir_index], f.name))

    def roll_back(self) -> None:
        """Make the kept previous version current again (a rank ahead of its peers after a crash); the
        newer version's files are deleted. Raises StoreError if no previous version is kept or writes
        are uncommitted."""
        with self._lock:
            prev = self.previous
            if prev is None or any(e.pending is not None for e in self._ext.values()):
                raise StoreError(f"the store in {self.dirs[0]} keeps no previous version to go back to")
            write_manifest(self.dirs[0], prev)
            os.unlink(os.path.join(self.dirs[0], PREVIOUS))
            self._close_files()
            for e in self._ext.values():
                e.committed, e.spares = None, []
            self.previous = None
            self._load_files(prev["files"], {})
            self.version, self.meta = prev["version"], prev.get("meta", {})

    def forget_previous(self) -> None:
        """Stop keeping the previous version found at ``open`` (its manifest and the files only it names
        are deleted); nothing if there is none."""
        with self._lock:
            prev, self.previous = self.previous, None
            if prev is None:
                return
            os.unlink(os.path.join(self.dirs[0], PREVIOUS))
            current = {(f.dir_index, f.name) for e in self._ext.values() for f in (e.committed or [])}
            for entry in prev["files"].values():
                for d, fname, _ in entry:
                    if (d, fname) not in current:
                        os.unlink(os.path.join(self.dirs[d], fname))

    def abort(self) -> None:
        """Discard every write since the last commit (the committed version stays current)."""
        with self._lock:
            dirty = [e for e in self._ext.values() if e.pending is not None]
        wait([e.write_future for e in dirty if e.write_future is not None])
        with self._lock:
            for e in dirty:
                if e.pending is not None:
                    e.spares.append(e.pending)
                e.pending, e.write_future = None, None

    def close(self) -> None:
        """Abort uncommitted writes, close every file and stop the I/O threads."""
        if self._closed:
            return
        self.abort()
        self._close_files()
        self.io.shutdown()
        self._closed = True

    def _close_files(self) -> None:
        for e in self._ext.values():
            for files in [e.committed or []] + e.spares:
                for f in files:
                    self.io.close(f.handle)
        for files in self._held:
            for f in files:
                self.io.close(f.handle)
        self._held = []

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _previous_of(dirs: list[str], body: dict) -> dict | None:
    """The kept previous version's manifest body (in ``dirs[0]``) if it is this store's version just
    before ``body``'s and every file it names exists; else None (a stale or damaged one is ignored; the
    next commit with ``agree`` replaces it)."""
    if not os.path.exists(os.path.join(dirs[0], PREVIOUS)):
        return None
    try:
        prev = read_manifest(dirs[0], PREVIOUS)
    except ManifestError:
        return None
    if prev.get("store_id") != body["store_id"] or prev.get("version") != body["version"] - 1:
        return None
    named = [os.path.join(dirs[d], fname) for entry in prev["files"].values() for d, fname, _ in entry]
    return prev if all(os.path.exists(p) for p in named) else None


def _remove_store_files(d: str) -> None:
    for fname in os.listdir(d):
        if fname.endswith(".fy") or fname.startswith(MANIFEST) or fname == ID_FILE:
            os.unlink(os.path.join(d, fname))
