"""The host-RAM tier: chosen extents live in host memory instead of on SSD, in front of the store.

``Plan.ram_weight_blocks`` = N puts ``w/<block>`` of blocks 0…N−1 in RAM, ``Plan.ram_state_blocks`` = M
puts every ``s/<block>/<chunk>`` of blocks 0…M−1 there. ``RamTier`` has the ``read``/``write``/``commit``/
``abort`` interface the weight loader, the Adam stage and the step use: a RAM extent's read is a
memcpy into the caller's buffer on the tier's own copy thread (the future completes when it is done:
a read of a layer's weights takes milliseconds, which the thread that launches the device's work must
not spend), its write a memcpy into the RAM copy done when the call returns (its callers are the Adam
stage's threads); both are timed on the timeline's ``ram_copy`` resource (host memory to host memory,
not a device copy) and never counted as SSD bytes. Optimizer state in RAM is not copied at all: the
Adam stage updates it in place (``view`` + ``touch``). Every other extent goes to the store unchanged.

Memory: one page-aligned host buffer per tier class (weights, state), reserved in the engine's
``HostBufferPool`` (not pinned: it never crosses PCIe), so a ``--cpu-memory`` too small for the tier
fails up front with the pool's message naming ``ram-tier …``; each extent is a 4 KiB-aligned slice.

Crash safety: between flushes the RAM copy is the only current one. Per-step commits do not write
RAM extents (no SSD traffic), so such a version carries ``"ram_tier_stale": true`` in its metadata
and must not be resumed from or exported. ``persist`` (``Engine.flush``/``close``) writes every RAM
extent changed since the last persist to the store and commits a complete version
(``"ram_tier_stale": false``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fuyou.device.host_threads import host_copy, serial_worker
from fuyou.errors import ConfigError, FuyouError, StoreError
from fuyou.models.store_layout import ModelLayout
from fuyou.schedule.sizing import RAM_STATE, RAM_WEIGHTS
from fuyou.storage.extents import ExtentSpec
from fuyou.storage.io_base import gather
from fuyou.storage.run_meta import STALE
from fuyou.storage.store import TensorStore, stage_of_extent
from fuyou.timeline import Timeline
from fuyou.transfer.futures import done_future
from fuyou.transfer.host_pool import HostBuffer, HostBufferPool
from fuyou.units import HOST_ALIGN, align_up


def ram_extents(
    layout: ModelLayout, weight_blocks: int, state_blocks: int
) -> tuple[list[ExtentSpec], list[ExtentSpec]]:
    """(weight extents, state extents) held in RAM for the first ``weight_blocks``/``state_blocks`` blocks
    (at most the block count: ``fuyou.schedule.rules.check_ram_tier``); a block's read-only part
    (``layout.f``) goes with its weights."""
    ws = [e for b in range(weight_blocks) for e in (layout.w(b), layout.f(b)) if e is not None]
    ss = [layout.s(b, c) for b in range(state_blocks) if layout.trains(b) for c in range(len(layout.chunks(b)))]
    return ws, ss


class RamTier:
    """The store with RAM-resident extents in front of it; see the module docstring."""

    def __init__(
        self,
        store: TensorStore,
        pool: HostBufferPool,
        layout: ModelLayout,
        timeline: Timeline,
        weight_blocks: int,
        state_blocks: int,
        agree: Callable[[int], object] | None = None,
    ) -> None:
        """Reserve the RAM copies in ``pool`` (raises HostMemoryError naming the tier if the host budget
        is too small; ConfigError if a count passes the number of blocks). Contents start undefined:
        fill them with ``write_through`` (import) or ``load`` (resume). ``agree``: the ranks' confirmation
        of every commit (``TensorStore.commit``), None for one process."""
        self.store, self.timeline, self.agree = store, timeline, agree
        self.ram: dict[str, torch.Tensor] = {}
        self.dirty: set[str] = set()
        """RAM extents written since the last ``persist`` (their SSD copies are stale)."""
        self.uncommitted: set[str] = set()
        """RAM extents written since the last commit or abort."""
        self._held: list[HostBuffer] = []
        ws, ss = ram_extents(layout, weight_blocks, state_blocks)
        for cls, exts in ((RAM_WEIGHTS, ws), (RAM_STATE, ss)):
            self._carve(pool, cls, exts)
        self._copier = (
            ThreadPoolExecutor(1, thread_name_prefix="fuyou-ram-tier", initializer=serial_worker) if self.ram else None
        )
        """The thread that copies RAM extents out (``read``): one, so reads run in the order issued."""

    def close(self) -> None:
        """Stop the copy thread once the reads in flight are done (the engine closes the tier, then the store)."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)

    def _carve(self, pool: HostBufferPool, cls: str, exts: list[ExtentSpec]) -> None:
        """One pool buffer for ``exts``, sliced at 4 KiB boundaries."""
        if not exts:
            return
        sizes = [align_up(e.nbytes, HOST_ALIGN) for e in exts]
        pool.reserve(cls, sum(sizes), 1)
        buf = pool.acquire(cls)
        self._held.append(buf)
        off = 0
        for e, size in zip(exts, sizes):
            self.ram[e.name] = buf.data[off : off + e.nbytes]
            off += size

    # ---------------------------------------------------------------- data path (the store's interface)
    @property
    def names(self) -> list[str]:
        """Names of the RAM-resident extents."""
        return list(self.ram)

    def holds(self, name: str) -> bool:
        """Whether extent ``name`` lives in RAM."""
        return name in self.ram

    def read(self, name: str, buf: torch.Tensor) -> Future:
        """Latest data of extent ``name`` into ``buf`` (a contiguous uint8 CPU tensor of ≥ its bytes).

        RAM extents: copied on the tier's copy thread, the future completes after the copy (raises
        ConfigError at once if ``buf`` cannot hold the extent); others: ``store.read``. The RAM copy
        must not change until then: its writers (the Adam stage's) are ordered after the reads of the
        block's old weights by the step, the reads after the writes by the loader's gate.
        """
        src = self.ram.get(name)
        if src is None:
            return self.store.read(name, buf)
        dst = _bytes(buf, src.numel(), name)
        assert self._copier is not None  # made whenever the tier holds an extent
        return self._copier.submit(self._copy_out, name, src, dst)

    def _copy_out(self, name: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        """(Copy thread.) ``dst`` ← ``src``, timed and charged."""
        t0, c0 = time.perf_counter(), time.thread_time()
        host_copy(dst, src)
        self.timeline.add("ram_copy", f"ram→host {name}", t0, time.perf_counter(), src.numel())
        self._charge(name, "copy_out", c0, src.numel())

    def write(self, name: str, buf: torch.Tensor) -> Future:
        """Write extent ``name`` from ``buf``. RAM extents: copied into RAM now (done future), no SSD
        traffic until ``persist``; others: ``store.write``."""
        dst = self.ram.get(name)
        if dst is None:
            return self.store.write(name, buf)
        t0, c0 = time.perf_counter(), time.thread_time()
        host_copy(dst, _bytes(buf, dst.numel(), name))
        self.timeline.add("ram_copy", f"host→ram {name}", t0, time.perf_counter(), dst.numel())
        self._charge(name, "copy_in", c0, dst.numel())
        self.dirty.add(name)
        self.uncommitted.add(name)
        return done_future()

    def _charge(self, name: str, op: str, c0: float, nbytes: int) -> None:
        """Charge this thread's CPU time since ``c0`` (``time.thread_time``) for a RAM copy of extent
        ``name`` to the store's CPU meter (stage ``ram_weights``/``ram_state``), if one is attached."""
        meter = self.store.io.meter
        if meter is not None:
            meter.add(f"ram_{stage_of_extent(name)}", op, time.thread_time() - c0, nbytes)

    def view(self, name: str) -> torch.Tensor | None:
        """The RAM copy of extent ``name`` (a uint8 host tensor, updated in place by the caller), or
        None if it lives on SSD. Call ``touch`` before changing it."""
        return self.ram.get(name)

    def touch(self, name: str) -> None:
        """Record that the RAM copy of ``name`` is about to change in place (dirty and uncommitted, so a
        step that fails midway leaves it unpersisted and the store marked stale)."""
        self.dirty.add(name)
        self.uncommitted.add(name)

    def write_through(self, name: str, buf: torch.Tensor) -> Future:
        """Write extent ``name`` to the store and, if it is a RAM extent, to its RAM copy too (import):
        the RAM copy then equals the stored one (not dirty)."""
        dst = self.ram.get(name)
        if dst is not None:
            dst.copy_(_bytes(buf, dst.numel(), name))
        return self.store.write(name, buf)

    def load(self) -> None:
        """Fill every RAM copy from the store's latest data (resume of a non-stale version)."""
        gather([self.store.read(name, t) for name, t in self.ram.items()]).result()
        self.dirty.clear()
        self.uncommitted.clear()

    # ---------------------------------------------------------------- versions
    def commit(self, meta: dict) -> int:
        """Commit the store's writes with ``meta`` plus ``ram_tier_stale`` (True while any RAM extent
        changed since the last ``persist``); returns the version. Raises as ``TensorStore.commit``."""
        version = self.store.commit({**meta, STALE: bool(self.dirty)}, self.agree)
        self.uncommitted.clear()
        return version

    def abort(self) -> None:
        """Discard the store's uncommitted writes. Raises FuyouError if a RAM extent was written since
        the last commit: RAM writes cannot be rolled back (the step schedules them after the last
        finiteness check, so this is a bug, not a user error)."""
        self.store.abort()
        if self.uncommitted:
            raise FuyouError(
                f"internal error: RAM-tier extents {sorted(self.uncommitted)[:3]} were updated by a "
                "step that is being rolled back"
            )

    def persist(self, meta: dict) -> int | None:
        """Write every RAM extent changed since the last persist to the store and commit a complete
        version (``ram_tier_stale`` False); returns it, or None when nothing was to write.

        Skipped (None) while RAM holds writes of an uncommitted step (a step that failed midway):
        persisting those would commit a mix of two steps; the last committed version stays marked
        stale. Raises StoreError if a write or the commit fails.
        """
        if self.uncommitted or not self.dirty:
            return None
        futs = [
            self.timeline.track(self.store.write(name, self.ram[name]), "ssd_write", name, self.ram[name].numel())
            for name in sorted(self.dirty)
        ]
        gather(futs).result()
        self.dirty.clear()
        return self.commit(meta)


def _bytes(buf: torch.Tensor, nbytes: int, name: str) -> torch.Tensor:
    """The first ``nbytes`` bytes of ``buf`` as a flat uint8 tensor; raises ConfigError if too small."""
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
        raise ConfigError(f"RAM-tier extent {name!r}: the buffer must be a contiguous CPU tensor")
    flat = buf.reshape(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise ConfigError(f"RAM-tier extent {name!r}: buffer holds {flat.numel()} bytes, the extent needs {nbytes}")
    return flat[:nbytes]


def refuse_stale(meta: dict, where: str) -> None:
    """Raise StoreError if the committed version described by ``meta`` has stale RAM-tier extents."""
    if meta.get(STALE):
        raise StoreError(
            f"the last committed step ({meta.get('step', '?')}) of the store in {where} kept weights or "
            "optimizer state in host RAM and the run ended without writing them back (no flush), so "
            "the store is incomplete; resume from a checkpoint instead (--resume auto)"
        )
