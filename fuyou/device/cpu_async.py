"""The asynchronous CPU backend: a CPU "device" that orders copies the way a GPU does (a test mode).

The plain CPU backend hides every ordering mistake: its streams are null, its copies run at once and
its events are complete when recorded. This backend keeps the CPU's arithmetic (so results stay
bit-identical to the plain backend's) but makes the data path asynchronous and hostile:

* Each stream (``new_stream``) is a worker thread that runs the copies issued on it
  (``Backend.copy``) in order, each after a random delay of 0…``max_delay`` seconds drawn from a
  seeded generator. Compute — the current stream, ``None`` as on the plain backend — stays
  synchronous on the calling thread.
* ``record(stream)`` returns an event that completes when the stream has run everything issued on it
  before; ``query`` is honest. ``event.wait(stream)`` queues a wait, so the stream's later work starts
  after the event; ``event.wait(None)`` blocks the calling thread (a ``threading.Event``, no spinning).
  ``synchronize`` drains every stream.
* Memory given back is poisoned — 0xFF bytes, NaN in every floating dtype, before it can be reused:
  device memory freed by ``free_storage`` or by dropping its last reference, and host buffers
  returned to their pool (``poison``). Fresh device and host memory starts poisoned too. A copy that
  still reads memory given back, or compute that reads a device buffer before its copy landed, sees
  NaN.
* Device memory dropped while a copy on a stream still uses it is poisoned and reusable at once, as
  CUDA's caching allocator would reuse it, unless ``keep_alive`` was called for it (CUDA's
  ``record_stream``): then it is refunded at once but reused only after the stream's copy.
* A copy whose device memory compute handed out (``device_empty``, ``restore_storage``) after the
  stream last waited for compute raises ``OrderingHazard``. Compute is synchronous here, so a copy
  stream that does not wait for compute cannot read half-written data on CPU, but on a GPU it could;
  this makes the missing ``record().wait(stream)`` fail instead.
* Memory handed out for a stream (``device_empty(..., stream=s)``: CUDA's caching allocator takes it
  from ``s``'s pool, the FSDP pattern) may be copied into on ``s`` without that wait, since ``s``
  reuses it only after what ``s`` itself queued; compute (or another stream) reading it must say so
  (``keep_alive(t, compute)``, CUDA's ``record_stream``) before the next allocation for a stream,
  else that allocation raises ``OrderingHazard``: on a GPU the stream could refill the memory while
  compute still reads it.

Device memory goes through the same caching arena as the plain backend (``arena=True``), or, with
``arena=False``, through ``Backend.free_storage``/``restore_storage``'s storage resize — the path the
CUDA backend takes. Accounting stays exact either way (without the arena, memory a queued copy still
references is counted until the copy has run).

``get_backend`` returns this backend for ``cpu`` when ``FUYOU_CPU_ASYNC`` is set: ``1`` or ``arena``
(the arena), ``resize`` (the storage resize path); ``FUYOU_CPU_ASYNC_SEED`` seeds the delays
(default 0). The test suite's ``--cpu-async=arena|resize`` option sets it.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from fuyou.device import cpu_arena
from fuyou.device.base import Event, MemoryStats
from fuyou.device.cpu import CPUBackend
from fuyou.errors import ConfigError, FuyouError

ENV = "FUYOU_CPU_ASYNC"
"""Environment variable selecting this backend for ``--device cpu``: ``1``/``arena`` or ``resize``."""
SEED_ENV = "FUYOU_CPU_ASYNC_SEED"
"""Environment variable seeding the copies' random delays (an integer; default 0)."""
MODES = {"1": True, "arena": True, "resize": False}
"""``FUYOU_CPU_ASYNC`` values → whether device memory goes through the caching arena."""

POISON = 0xFF
"""The byte released memory is filled with: NaN in fp16, bf16, fp32 and fp64."""


class OrderingHazard(FuyouError):
    """A copy on a stream touches device memory compute handed out after the stream last waited for
    compute: on a GPU the copy could run before compute is done with that memory."""


def mode() -> bool | None:
    """From ``FUYOU_CPU_ASYNC``: None (unset, empty or ``0``: the plain CPU backend), True (the arena)
    or False (the storage resize path). Raises ConfigError for another value."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0"):
        return None
    if value not in MODES:
        raise ConfigError(f"{ENV} must be 1, arena or resize (or 0/unset: off), got {value!r}")
    return MODES[value]


def seed() -> int:
    """From ``FUYOU_CPU_ASYNC_SEED`` (default 0); raises ConfigError if it is not an integer."""
    value = os.environ.get(SEED_ENV, "0")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{SEED_ENV} must be an integer, got {value!r}") from None


def _poison_storage(s: torch.UntypedStorage) -> None:
    if s.nbytes():
        s.fill_(POISON)  # type: ignore[attr-defined]  # torch's stubs lack UntypedStorage.fill_


def _poison_tensor(t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    if t.is_contiguous():
        t.view(-1).view(torch.uint8).fill_(POISON)
    else:
        t.fill_(float("nan") if t.is_floating_point() else -1)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``t``'s memory with a version counter of its own (``detach`` would share it)."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _cdata(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (the C++ StorageImpl, shared by every view)."""
    return t.untyped_storage()._cdata


class _Pending:
    """Device storages referenced by copies still queued on streams, and the lock that orders memory
    operations (allocation, free, restore) against the workers' copies.

    ``refs[c]``: how many references queued work holds to storage ``c`` (a ``_cdata``), each a private
    alias (a tensor of its own), so the storage's use count is the arena's + the engine's + these;
    ``protected[c]``: how many of them ``keep_alive`` asked to protect.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.refs: Counter[int] = Counter()
        self.protected: Counter[int] = Counter()

    def hold(self, tensors: tuple[torch.Tensor, ...], protect: bool) -> tuple[torch.Tensor, ...]:
        """Private aliases of ``tensors`` counted as held by queued work (call with ``lock`` held).

        An alias has its own autograd version counter: a queued copy writing it later does not bump
        the version of the caller's tensor (``copy`` bumps that when the copy is issued, as CUDA does).
        """
        aliases = tuple(_alias(t) for t in tensors)
        for a in aliases:
            c = _cdata(a)
            self.refs[c] += 1
            if protect:
                self.protected[c] += 1
        return aliases

    def drop(self, aliases: tuple[torch.Tensor, ...], protect: bool) -> None:
        """Uncount ``aliases`` (call with ``lock`` held; the caller drops them after)."""
        for a in aliases:
            c = _cdata(a)
            for counter in (self.refs, self.protected) if protect else (self.refs,):
                counter[c] -= 1
                if counter[c] <= 0:
                    del counter[c]


class _AsyncArena(cpu_arena.CachingArena):
    """The caching arena, with poisoning and streams: blocks are poisoned when handed out and when
    freed; a storage whose only other references are queued copies counts as freed (refunded), and
    is reused at once unless ``keep_alive`` protects it (then only after those copies)."""

    def __init__(self, capacity: int, pending: _Pending) -> None:
        super().__init__(capacity)
        self._lock = pending.lock  # one lock for the arena and the queued copies: no lock order to keep
        self._pending = pending
        self._deferred: dict[int, torch.UntypedStorage] = {}

    def _block(self, nbytes: int, what: str) -> torch.UntypedStorage:
        s = super()._block(nbytes, what)
        _poison_storage(s)
        return s

    def _put(self, s: torch.UntypedStorage) -> None:
        _poison_storage(s)
        super()._put(s)

    def _sweep(self) -> None:
        p = self._pending
        with p.lock:
            for key, (s, n) in list(self._lent.items()):
                c = s._cdata
                if cpu_arena._use_count(s) != 1 + p.refs[c]:
                    continue  # someone besides the arena and queued copies holds it: live
                del self._lent[key]
                self.allocated -= n
                if not s.nbytes():
                    continue
                if p.protected[c]:
                    self._deferred[key] = s  # keep_alive: reused once the stream's copies are done
                else:
                    self._put(s)  # a queued copy still touching it now sees poison (or the next user)
            for key, ref in list(self._foreign_refs.items()):  # compute's tensors only queued copies hold
                held = ref()
                if held is not None and cpu_arena._use_count(held) == 1 + p.refs[held._cdata]:
                    self._refund_foreign(key)
                del held
            for key, s in list(self._deferred.items()):
                if cpu_arena._use_count(s) == 1:
                    del self._deferred[key]
                    self._put(s)
        self._trim()


class _Stream:
    """A worker thread running the tasks queued on it in order (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.horizon = -1
        """The latest compute epoch this stream's later work is ordered after (``OrderingHazard``)."""
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        thread = threading.Thread(
            target=_work, args=(self._queue, weakref.ref(self)), name=f"fuyou-{name}", daemon=True
        )
        thread.start()
        weakref.finalize(self, self._queue.put, None)  # the thread ends with its stream

    def put(self, task: Callable[[], None]) -> None:
        self._queue.put(task)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


def _work(tasks: queue.SimpleQueue, ref: weakref.ref[_Stream]) -> None:
    """A stream's thread: runs its tasks until the stream is dropped (holding it weakly meanwhile)."""
    while (task := tasks.get()) is not None:
        try:
            task()
        except BaseException as e:  # noqa: BLE001 - surfaced by the stream's next event
            s = ref()
            if s is not None and s.error is None:
                s.error = e
        del task


class AsyncEvent(Event):
    """Completes when its stream has run the work issued before it (a ``threading.Event``)."""

    def __init__(self, stream: _Stream) -> None:
        self.horizon = stream.horizon
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._t: float | None = None

    def _set(self, stream: _Stream) -> None:
        self.error = stream.error
        self._t = time.perf_counter()
        self._done.set()

    def when(self) -> float | None:
        """When the stream's thread reached this event (None until it has)."""
        return self._t

    def wait(self, stream: Any | None = None) -> None:
        """Order ``stream``'s later work after this event, or block the calling thread (``None``)."""
        if stream is None:
            self._done.wait()
            if self.error is not None:
                raise FuyouError(f"a copy on an asynchronous CPU stream failed: {self.error}") from self.error
            return
        stream.horizon = max(stream.horizon, self.horizon)
        stream.put(self._done.wait)

    def query(self) -> bool:
        """Whether the work before this event has run."""
        return self._done.is_set()


class ComputeEvent(Event):
    """A point in compute's work: complete at once (compute is synchronous), but a stream that waits
    on it is ordered after compute's epoch ``epoch`` (``OrderingHazard``)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self._t = time.perf_counter()

    def when(self) -> float:
        """When compute (synchronous) reached this event: when it was recorded."""
        return self._t

    def wait(self, stream: Any | None = None) -> None:
        """Nothing to wait for; a stream records that its later work follows compute up to here."""
        if stream is not None:
            stream.horizon = max(stream.horizon, self.epoch)

    def query(self) -> bool:
        """Always complete."""
        return True


class AsyncCPUBackend(CPUBackend):
    """The CPU backend with asynchronous streams and poisoned memory; see the module docstring.

    ``capacity``: the fake device's bytes; ``seed``: the delays' generator; ``max_delay``: seconds;
    ``arena``: device memory through the caching arena (else the storage resize path CUDA uses).
    """

    def __init__(self, capacity: int = 2**62, seed: int = 0, max_delay: float = 0.005, arena: bool = True) -> None:
        super().__init__(capacity)
        self._pending = _Pending()
        if arena and not cpu_arena.SUPPORTED:
            raise FuyouError("this torch build lacks what the caching arena needs; use FUYOU_CPU_ASYNC=resize")
        self._arena = _AsyncArena(capacity, self._pending) if arena else None
        self.seed, self.max_delay = seed, max_delay
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()
        self._count = 0
        self._epoch = 0
        self._stamps: dict[int, tuple[int, str, Any]] = {}
        """Device storage (``_cdata``) → (compute epoch it was handed out in, what it holds, the stream
        it was handed out for or None)."""
        self._unkept: dict[int, str] = {}
        """Storages handed out for a stream that compute has not yet been named a user of (``keep_alive``)."""
        self._watch: dict[int, torch.UntypedStorage] = {}
        """Without the arena: device storages queued copies reference, until their tensors are gone
        (``_sweep``)."""

    # ---------------------------------------------------------------- memory
    def host_empty(self, nbytes: int, pinned: bool = True) -> torch.Tensor:
        """A page-aligned host buffer, poisoned until written (``pinned`` changes nothing)."""
        t = super().host_empty(nbytes, pinned)
        _poison_tensor(t)
        return t

    def host_staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for a transient copy, poisoned until written."""
        t = super().host_staging(shape, dtype)
        _poison_tensor(t)
        return t

    def host_staging_aligned(self, nbytes: int) -> torch.Tensor:
        """Page-aligned host staging, poisoned until written."""
        t = super().host_staging_aligned(nbytes)
        _poison_tensor(t)
        return t

    def poison(self, tensor: torch.Tensor) -> None:
        """Overwrite memory just given back with 0xFF bytes (NaN in every float dtype)."""
        _poison_tensor(tensor)

    def device_empty(
        self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "a tensor", stream: Any | None = None
    ) -> torch.Tensor:
        """A poisoned device tensor, stamped with compute's epoch and ``stream``; DeviceMemoryError past
        capacity, OrderingHazard if memory handed out for a stream before was never kept for compute."""
        with self._pending.lock:
            self._check_kept(stream)
            self._sweep()
            t = super().device_empty(shape, dtype, what)
            if self._arena is None:
                _poison_tensor(t)
            self._stamp(t, what, stream)
        return t

    def free_storage(self, tensor: torch.Tensor) -> None:
        """Poison and release the memory under ``tensor`` (a copy still using it sees poison)."""
        with self._pending.lock:
            if self._arena is None:
                _poison_storage(tensor.untyped_storage())
            super().free_storage(tensor)

    def restore_storage(
        self, tensor: torch.Tensor, nbytes: int, what: str = "a tensor", stream: Any | None = None
    ) -> torch.Tensor:
        """Poisoned memory back under a freed tensor, stamped with compute's epoch and ``stream``
        (raises as ``device_empty``)."""
        with self._pending.lock:
            self._check_kept(stream)
            self._sweep()
            alias = super().restore_storage(tensor, nbytes, what)
            if self._arena is None:
                _poison_tensor(alias)
            self._stamp(alias, what, stream)
        return alias

    def _check_kept(self, stream: Any | None) -> None:
        """Before memory is handed out for ``stream``: every earlier such hand-out was kept for compute."""
        if stream is not None and self._unkept:
            what = next(iter(self._unkept.values()))
            self._unkept.clear()
            raise OrderingHazard(
                f"device memory handed out for a copy stream ({what}) was never kept for compute "
                "(keep_alive(tensor, compute stream)): on a GPU the stream could refill it while compute "
                "still reads it"
            )

    def memory(self) -> MemoryStats:
        """As the plain backend's (serialised with the streams' copies)."""
        with self._pending.lock:
            self._sweep()
            return super().memory()

    def _sweep(self) -> None:
        """Without the arena (which does this itself): refund device storages whose tensors are all
        gone though queued copies still reference them — CUDA counts freed memory at once — and poison
        them unless ``keep_alive`` protects them (a copy still reading one then sees NaN)."""
        p = self._pending
        for c, s in list(self._watch.items()):
            if cpu_arena._use_count(s) == 1 + p.refs[c]:  # only this list and queued copies hold it
                del self._watch[c]
                self._acct.forget(s)
                if not p.protected[c]:
                    _poison_storage(s)
            elif not p.refs[c]:
                del self._watch[c]  # its copies have run; it is live: accounted as usual

    def _adopt(self, storage: torch.UntypedStorage, what: object) -> None:
        """Charge a storage compute allocated; without the arena, watch it like ``device_empty``'s, so
        it counts as freed once only queued copies hold it (as CUDA counts it)."""
        with self._pending.lock:
            super()._adopt(storage, what)
            if self._arena is None:
                c = storage._cdata
                if c not in self._stamps:
                    weakref.finalize(storage, self._stamps.pop, c, None)
                self._stamps[c] = (self._epoch, str(what), None)

    def _watch_device(self, aliases: tuple[torch.Tensor, ...]) -> None:
        """Without the arena: watch the device storages among ``aliases`` (held by queued work)."""
        if self._arena is None:
            for a in aliases:
                c = _cdata(a)
                if c in self._stamps:
                    self._watch.setdefault(c, a.untyped_storage())

    def _stamp(self, t: torch.Tensor, what: str, stream: Any | None) -> None:
        storage = t.untyped_storage()
        c = storage._cdata
        if c not in self._stamps:
            weakref.finalize(storage, self._stamps.pop, c, None)
        self._stamps[c] = (self._epoch, what, stream)
        if stream is not None:
            self._unkept[c] = what

    # ---------------------------------------------------------------- streams
    def new_stream(self) -> _Stream:
        """A new stream: a worker thread running its copies in order, after random delays."""
        self._count += 1
        s = _Stream(f"cpu-async-{self._count}")
        self._streams.add(s)
        return s

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """Torch work inside runs on the calling thread, after ``stream``'s queued work (only
        ``copy`` is deferred)."""
        if stream is not None:
            self.record(stream).wait()
        return nullcontext()

    def record(self, stream: Any | None = None) -> Event:
        """An event after the work issued so far on ``stream`` (``None``: compute, complete at once)."""
        if stream is None:
            self._epoch += 1
            return ComputeEvent(self._epoch - 1)
        ev = AsyncEvent(stream)
        stream.put(lambda: ev._set(stream))
        return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any | None = None) -> Event:
        """Queue ``dst.copy_(src)`` on ``stream``'s thread after a random delay (``None``: now).

        Raises OrderingHazard if ``dst`` or ``src`` is device memory compute handed out after
        ``stream`` last waited for compute.
        """
        if stream is None:
            dst.copy_(src)
            return self.record(None)
        for t in (dst, src):
            stamp = self._stamps.get(_cdata(t))
            if stamp is not None and stamp[2] is not stream and stamp[0] > stream.horizon:
                raise OrderingHazard(
                    f"a copy on {stream!r} touches device memory ({stamp[1]}) compute handed out after the "
                    "stream last waited for compute: on a GPU the copy could run before compute is done "
                    "with that memory; order the stream after compute first (backend.record().wait(stream))"
                )
        with self._rng_lock:
            delay = self._rng.uniform(0.0, self.max_delay)
        torch.autograd.graph.increment_version(dst)  # written now, as far as autograd knows (as on CUDA)
        p = self._pending
        with p.lock:
            aliases = p.hold((dst, src), protect=False)
            self._watch_device(aliases)
            expect = [(a.data_ptr(), a.untyped_storage().nbytes()) for a in aliases]

        def run() -> None:
            nonlocal aliases
            time.sleep(delay)
            with p.lock:
                d, s = aliases
                valid = [(a.data_ptr(), a.untyped_storage().nbytes()) == e for a, e in zip(aliases, expect)]
                if valid[0] and valid[1]:
                    d.copy_(s)
                elif valid[0]:  # the source was freed (and its memory moved) under the copy: garbage
                    _poison_tensor(d)
                p.drop(aliases, protect=False)
                aliases = ()

        stream.put(run)
        return self.record(stream)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until ``stream``'s queued copies have run (``None``:
        compute, synchronous here, uses it). Memory handed out for a stream is then kept for its other
        user (compute, or another stream: the collectives' reading an uploaded shard)."""
        stamp = self._stamps.get(_cdata(tensor))
        if stream is None or (stamp is not None and stamp[2] is not stream):  # kept for who else uses it
            self._unkept.pop(_cdata(tensor), None)
        if stream is None:
            return
        p = self._pending
        with p.lock:
            aliases = p.hold((tensor,), protect=True)
            self._watch_device(aliases)

        def release() -> None:
            nonlocal aliases
            with p.lock:
                p.drop(aliases, protect=True)
                aliases = ()

        stream.put(release)

    def synchronize(self) -> None:
        """Block until every stream has run its queued work."""
        for s in list(self._streams):
            self.record(s).wait()
