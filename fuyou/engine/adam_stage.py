"""The Adam stage: state SSD → host, CPU AdamW, state and new weights → SSD, block by block.

Per block, the device gradient is first copied into a host buffer (``offload``, done by
``fuyou.transfer.gradients``); ``update`` reads the block's master/m/v from the store, runs the fused
AdamW on the Adam worker thread (writing the new compute weights into a host buffer in the same
pass) and writes both extents back. Everything is chained on futures: the training thread only
submits, and the returned future completes when the block's new weights are in the store (readable
by the next step). Until the weights' write lands, a read of the block takes them from the host
buffer instead (``fuyou.transfer.new_weights``). State and weights go through the ``RamTier`` facade: RAM-tier extents are
memcpys, not SSD traffic.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

import torch

from fuyou.device.base import Backend, Event
from fuyou.device.host_threads import serial_worker
from fuyou.engine.state_update import for_format
from fuyou.models.store_layout import ModelLayout
from fuyou.optim import AdamWHyper, AdamWorker
from fuyou.schedule.sizing import GRADS, NEW_WEIGHTS, STATE
from fuyou.storage.io_base import gather
from fuyou.timeline import Timeline
from fuyou.transfer.futures import chain, done_future
from fuyou.transfer.gradients import GradientOffload
from fuyou.transfer.host_pool import HostBuffer, HostBufferPool
from fuyou.transfer.new_weights import NewWeights
from fuyou.transfer.ram_tier import RamTier

_KEPT_STEPS = 64
"""Steps whose update futures ``AdamStage`` keeps for ``served`` beyond those still running."""


class AdamStage:
    """Offload (through ``gradients``), update and write back one block at a time; see the module
    docstring."""

    def __init__(
        self,
        store: RamTier,
        backend: Backend,
        pool: HostBufferPool,
        layout: ModelLayout,
        hyper: AdamWHyper,
        timeline: Timeline,
        d2h_stream: object,
        num_threads: int | None = None,
        no_decay: frozenset[str] = frozenset(),
    ) -> None:
        self.store, self.backend, self.pool, self.layout = store, backend, pool, layout
        self.no_decay = no_decay
        self.timeline = timeline
        self.gradients = GradientOffload(backend, pool, layout, timeline, d2h_stream)
        self.rule = for_format(layout.optimizer_state, layout.compute_dtype)
        """How a chunk's master is kept and updated (``fuyou.engine.state_update``)."""
        self.worker = AdamWorker(hyper, step_fn=self._timed_step, num_threads=num_threads)
        self.new_weights = NewWeights(timeline, store.store.io)
        """Each block's new weights, handed to a read of the block while their buffer is held."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._served: dict[int | None, list[Future]] = {}
        """Each step's updates (by the timeline's ledger key of the step they serve), until ``served``."""
        self._lock = threading.Lock()
        self._nonfinite: set[int] = set()
        self._feeder = threading.Thread(target=self._feed, name="fuyou-adam-feeder", daemon=True)
        self._feeder.start()

    def _runs(self, b: int, lo: int, hi: int) -> list[tuple[int, int, bool]]:
        """Decay runs of block ``b`` clipped to the chunk [lo, hi)."""
        out = [(max(a, lo), min(z, hi), d) for a, z, d in self.layout.decay_runs(b, self.no_decay)]
        return [(a, z, d) for a, z, d in out if z > a]

    def _io(self, fut: Future, resource: str, name: str, nbytes: int, key: int | None) -> Future:
        """Record an SSD read/write of extent ``name`` on the timeline, for the step ``key`` the update
        serves; RAM-tier extents are not SSD traffic (the tier records their memcpys itself)."""
        return fut if self.store.holds(name) else self.timeline.track(fut, resource, name, nbytes, key)

    def served(self, key: int | None) -> list[Future]:
        """The futures of the updates queued for step ``key`` (the timeline's ledger key), forgotten now:
        once they are done, every transfer of those updates has been issued (and has landed)."""
        with self._lock:
            return self._served.pop(key, [])

    def _remember(self, key: int | None, out: Future) -> None:
        """Keep ``out`` for ``served``; steps nobody asks about are forgotten once their updates are done."""
        with self._lock:
            self._served.setdefault(key, []).append(out)
            if len(self._served) > _KEPT_STEPS:
                for k in [k for k, fs in self._served.items() if k != key and all(f.done() for f in fs)]:
                    del self._served[k]

    def _timed_step(
        self, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, **kw: object
    ) -> bool:
        t0 = time.perf_counter()
        finite = self.rule.step(master, m, v, grad, **kw)
        self.timeline.add("adam", f"adam {master.numel()}", t0, time.perf_counter(), master.numel())
        return finite

    def take_nonfinite(self) -> set[int]:
        """Blocks whose update since the last call produced a non-finite master value (the Adam stage's
        own check of the gradients it received), and forget them."""
        with self._lock:
            out, self._nonfinite = self._nonfinite, set()
        return out

    def _check(self, b: int, jobs: Future) -> None:
        """Done-callback of a chunk's jobs: note block ``b`` if an update came out non-finite."""
        if jobs.exception() is None and not all(j.finite for j in jobs.result()):
            with self._lock:
                self._nonfinite.add(b)

    def offload(
        self, b: int, grad: torch.Tensor, cls: str = GRADS, after: Event | None = None
    ) -> tuple[HostBuffer, Event]:
        """Copy block ``b``'s flat device gradient into a host buffer of class ``cls``
        (``GradientOffload.offload``, on this stage's device-to-host stream)."""
        return self.gradients.offload(b, grad, cls, after)

    def update(
        self,
        b: int,
        grad: HostBuffer | Callable[[int | None], tuple[HostBuffer, Event]],
        ready: Event | None,
        lr: float,
        step: int,
        scale: float,
        hold: bool = False,
    ) -> Future:
        """Queue AdamW for block ``b``; returns at once with a future for the written block. ``hold``:
        the next read of the block (the next forward's) is sure to come, so its new weights wait in
        their buffer for it (``NewWeights.expect``; RAM-tier weights never do).

        ``grad`` is the host gradient (complete once ``ready``), or a callable the feeder runs first
        to obtain both (a gradient parked on SSD: ``grad_park``). The feeder thread takes the state
        and weight buffers (waiting there, not on the training thread, when all are in flight) and
        chains read → update → write; see ``_update_now``.
        """
        out: Future = Future()
        key = self.timeline.serving
        self._remember(key, out)
        self.new_weights.expect(b, hold and not self.store.holds(self.layout.w(b).name))
        self._queue.put((b, grad, ready, lr, step, scale, out, key))
        return out

    def _feed(self) -> None:
        """Feeder thread: start queued block updates in order, relaying their completion."""
        serial_worker()
        while (item := self._queue.get()) is not None:
            b, grad, ready, lr, step, scale, out, key = item
            try:
                if callable(grad):  # a parked gradient's read serves the update's step
                    grad, ready = grad(key)
                fut = self._update_now(b, grad, ready, lr, step, scale, key)
            except BaseException as e:  # noqa: BLE001 - surfaced through the block's future
                if isinstance(grad, HostBuffer):
                    self.pool.release(grad)
                self.new_weights.retire(b, e, lambda: None)
                out.set_exception(e)
                continue

            def relay(f: Future, out: Future = out) -> None:
                if f.exception():
                    out.set_exception(f.exception())
                else:
                    out.set_result(None)

            fut.add_done_callback(relay)

    def _update_now(
        self, b: int, grad: HostBuffer, ready: Event, lr: float, step: int, scale: float, key: int | None
    ) -> Future:
        """Run AdamW for block ``b`` (1-based ``step``, gradient × ``scale``) and write it back; its
        transfers count for the timeline's step ``key``.

        State goes chunk by chunk (read, update, write), each chunk's new compute weights landing in
        one weight buffer that is written once all chunks are done (a split master first reads the old
        weights into it: ``StateUpdate.reads_weights``). The future completes once
        ``w/<b>`` and every ``s/<b>/<c>`` are written; ``grad`` is released after the last kernel,
        the state buffers after their writes, the weight buffer after its write.
        """
        w_ext = self.layout.w(b)
        wbuf = self.pool.acquire(NEW_WEIGHTS)
        old = done_future()
        if self.rule.reads_weights:
            old = self._io(self.store.read(w_ext.name, wbuf.data), "ssd_read", w_ext.name, w_ext.nbytes, key)
        chunk_writes = [
            self._chunk(b, c, grad, ready, wbuf, old, lr, step, scale, key) for c in range(len(self.layout.chunks(b)))
        ]
        jobs = gather([j for j, _ in chunk_writes])
        jobs.add_done_callback(lambda _: self.pool.release(grad))
        new = self.new_weights

        def publish(j: Future) -> None:  # before the write starts (callbacks run in order)
            if j.exception() is None:
                new.publish(b, w_ext.name, wbuf.data[: w_ext.nbytes])

        jobs.add_done_callback(publish)

        def write_weights() -> Future:
            return self._io(self.store.write(w_ext.name, wbuf.data), "ssd_write", w_ext.name, w_ext.nbytes, key)

        def retire(f: Future) -> None:  # hazard: no copy may read wbuf once it is back in the pool
            new.retire(b, f.exception(), partial(self.pool.release, wbuf))

        ww = chain(jobs, write_weights)
        ww.add_done_callback(retire)
        return gather([ww] + [w for _, w in chunk_writes])

    def _chunk(
        self,
        b: int,
        c: int,
        grad: HostBuffer,
        ready: Event,
        wbuf: HostBuffer,
        old: Future,
        lr: float,
        step: int,
        scale: float,
        key: int | None,
    ) -> tuple[Future, Future]:
        """Read, update and write state chunk ``c`` of block ``b`` once ``old`` (the read of the old
        weights into ``wbuf``, where the rule needs them) is done: (job future, write future)."""
        s_ext = self.layout.s(b, c)
        lo, hi = self.layout.chunks(b)[c]
        dt = self.layout.compute_dtype
        ram = self.store.view(s_ext.name)  # RAM tier: Adam updates the resident copy in place
        sbuf: HostBuffer | None = None
        if ram is not None:
            self.store.touch(s_ext.name)
            data, read = ram, done_future()
        else:
            sbuf = self.pool.acquire(STATE)
            data = sbuf.data
            read = self._io(self.store.read(s_ext.name, data), "ssd_read", s_ext.name, s_ext.nbytes, key)

        def start_job() -> Future:
            ready.wait()  # the gradient's device→host copy must have landed
            runs = [(a - lo, z - lo, d) for a, z, d in self._runs(b, lo, hi)]
            jobs = self.rule.jobs(
                s_ext.views(data), runs, wbuf.view(dt, hi)[lo:hi], grad.view(dt, hi)[lo:hi], s_ext.name,
                lr=lr, step=step, grad_scale=scale,
            )  # fmt: skip
            done = gather([self.worker.submit(job, on_done) for job, on_done in jobs])
            done.add_done_callback(partial(self._check, b))
            return done

        job = chain(gather([read, old]), start_job)

        if sbuf is None:
            return job, job

        def write_state() -> Future:
            return self._io(self.store.write(s_ext.name, sbuf.data), "ssd_write", s_ext.name, s_ext.nbytes, key)

        written = chain(job, write_state)
        written.add_done_callback(lambda _: self.pool.release(sbuf))
        return job, written

    def close(self) -> None:
        """Finish queued updates and stop the feeder and worker threads."""
        self._queue.put(None)
        self._feeder.join()
        self.worker.close()
