"""The Adam worker: one thread that runs per-layer AdamW updates from a queue, in order.

The training loop (main thread) submits a job as soon as a layer's gradient is in host memory and
goes on driving the GPU; the worker updates that layer's master, m, v (and bf16 weight copy) and
hands the job on: its ``Future`` completes and the optional ``on_done`` callback runs on the worker
thread (e.g. to queue the SSD write-back). The buffers of a job belong to the worker from
``submit`` until its future is done; the caller must not touch them in between.

Threads: this thread launches the Adam kernel while the training thread launches the gradient
norm's (``norm.py``); numba's ``workqueue`` layer aborts on concurrent launches, so both go through
``parallel.parallel_launch``, which serialises them under that layer only. Its numba thread count is
set inside the thread, since ``numba.set_num_threads`` is per thread. The thread runs torch's host
ops serially (``host_threads.serial_worker``), and numba should run on its ``tbb`` layer (the ``tbb``
dependency): a thread that owns an OpenMP team of its own makes libgomp stop spinning in every team of the
process (``fuyou.device.host_threads``), the training thread's included.

Errors: the first failing job's future gets the exception; every later queued job is skipped
(its future fails with ``AdamWorkerError``), since the state would be inconsistent; the next
``submit``, ``wait`` or ``close`` raises ``AdamWorkerError`` with the original as ``__cause__``.
Waits take timeouts and never hang on a dead worker.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numba
import torch

from fuyou.device.host_threads import serial_worker
from fuyou.errors import ConfigError, FuyouError
from fuyou.optim.adam_numba import adamw_step
from fuyou.optim.args import AdamWHyper, check_hyper, check_step_args


class AdamWorkerError(FuyouError, RuntimeError):
    """An update failed on the Adam worker, the worker is closed, or a wait timed out."""


class StepFn(Protocol):
    """Signature shared by ``adam_numba.adamw_step`` and ``reference.adamw_step_reference``."""

    def __call__(  # noqa: D102
        self, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, *,
        lr: float, step: int, hyper: AdamWHyper, grad_scale: float, out: torch.Tensor | None,
    ) -> bool | None: ...  # fmt: skip


@dataclass
class AdamJob:
    """One layer's update: flat buffers (see ``state.py``) and this step's scalars."""

    key: Hashable
    """Caller's name for the job, e.g. the layer index; used in error messages."""
    master: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    grad: torch.Tensor
    lr: float
    """Learning rate of this step."""
    step: int
    """1-based step count, for the bias corrections."""
    grad_scale: float = 1.0
    """Gradient multiplier (clipping coefficient)."""
    out: torch.Tensor | None = None
    """Optional bf16 buffer for the new weights."""
    weight_decay: float | None = None
    """Overrides the worker's weight decay for this job (e.g. 0 for biases and norm weights)."""
    finite: bool = True
    """Set by the worker: whether every new master value came out finite (the update function's
    verdict; one that returns None is trusted)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments of the update function (8-bit moments: their block scales and the
    chunk's weight-decay runs, ``fuyou.optim.quant8``)."""


OnDone = Callable[[AdamJob], None]
_Item = tuple[AdamJob, Future[AdamJob], OnDone | None]
_STOP = None
"""The queue's stop marker."""


class AdamWorker:
    """A thread running AdamW jobs in submission order. Use as a context manager or call close()."""

    def __init__(
        self, hyper: AdamWHyper, *, num_threads: int | None = None, step_fn: StepFn = adamw_step,
        name: str = "fuyou-adam",
    ) -> None:  # fmt: skip
        """Start the worker thread.

        Args:
            hyper: betas, eps, weight decay used for every job.
            num_threads: numba threads the kernel may use (default: numba's default, all cores).
            step_fn: the update function (the numba kernel; tests may pass the reference).

        Raises:
            ConfigError: if num_threads is not in [1, numba.config.NUMBA_NUM_THREADS].
        """
        limit = numba.config.NUMBA_NUM_THREADS
        if num_threads is not None and not (1 <= num_threads <= limit):
            raise ConfigError(f"num_threads={num_threads}; expected 1..{limit} (numba's pool size)")
        self._hyper, self._num_threads, self._step_fn = hyper, num_threads, step_fn
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._error_key: Hashable = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- caller side -------------------------------------------------------------------------
    def submit(self, job: AdamJob, on_done: OnDone | None = None) -> Future[AdamJob]:
        """Queue ``job``; return a future that resolves to it once updated (after ``on_done``).

        Raises:
            AdamWorkerError: if an earlier job failed or the worker is closed.
            ConfigError: if the job's lr, step, grad_scale or weight_decay is invalid (checked
                before queueing).
        """
        check_step_args(job.lr, job.step, job.grad_scale)
        if job.weight_decay is not None:
            h = self._hyper
            check_hyper(h.beta1, h.beta2, h.eps, job.weight_decay)
        fut: Future[AdamJob] = Future()
        with self._cond:
            self._raise_if_failed()
            if self._closed:
                raise AdamWorkerError("submit() on a closed AdamWorker")
            self._pending += 1
            self._queue.put((job, fut, on_done))
        return fut

    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted job is done (seconds; None = no limit).

        Raises:
            AdamWorkerError: if a job failed, or jobs are still pending after ``timeout``.
        """
        with self._cond:
            done = self._cond.wait_for(lambda: self._pending == 0 or self._error is not None, timeout)
            self._raise_if_failed()
            if not done:
                raise AdamWorkerError(f"{self._pending} Adam jobs still pending after {timeout} s")

    def close(self, *, cancel_pending: bool = False, timeout: float | None = 60.0) -> None:
        """Stop the thread: finish queued jobs (or cancel them), then join. Idempotent.

        Raises:
            AdamWorkerError: if a job failed, or the thread is still busy after ``timeout`` s.
        """
        self._shutdown(cancel_pending, timeout)
        with self._cond:
            self._raise_if_failed()

    def __enter__(self) -> AdamWorker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already on its way: stop quickly and do not mask it
            self._shutdown(cancel_pending=True, timeout=60.0)
        except AdamWorkerError:
            pass

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet finished."""
        with self._cond:
            return self._pending

    def _raise_if_failed(self) -> None:
        """Raise AdamWorkerError from the first failure, if any (caller holds ``_cond``)."""
        if self._error is not None:
            msg = f"Adam update of job {self._error_key!r} failed: {self._error!r}"
            raise AdamWorkerError(msg) from self._error

    def _shutdown(self, cancel_pending: bool, timeout: float | None) -> None:
        """Mark closed, optionally cancel queued jobs, send the stop marker and join."""
        if threading.current_thread() is self._thread:
            raise AdamWorkerError("close() called from the Adam worker thread (e.g. in on_done)")
        with self._cond:
            if not self._closed:
                self._closed = True
                if cancel_pending:
                    self._cancel_queued()
                self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AdamWorkerError(f"Adam worker still busy {timeout} s after close(); not joined")

    def _cancel_queued(self) -> None:
        """Cancel every job still in the queue (caller holds ``_cond``)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                item[1].cancel()
                self._pending -= 1
            self._cond.notify_all()

    # ---- worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        """Thread body: take jobs until the stop marker (after a failure, only to skip them)."""
        try:
            serial_worker()  # its torch ops (the callbacks' copies) get no OpenMP team: see host_threads
            if self._num_threads is not None:
                numba.set_num_threads(self._num_threads)
        except BaseException as err:  # noqa: BLE001 - reported by submit/wait/close
            self._record_error(err, "<worker start>")
        while (item := self._queue.get()) is not _STOP:
            job, fut, on_done = item
            try:
                self._run_one(job, fut, on_done)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _run_one(self, job: AdamJob, fut: Future[AdamJob], on_done: OnDone | None) -> None:
        """Update one job and resolve its future; skip it if an earlier job failed."""
        if not fut.set_running_or_notify_cancel():
            return
        if self._error is not None:
            fut.set_exception(AdamWorkerError(f"job {job.key!r} skipped: an earlier job failed"))
            return
        try:
            hyper = self._hyper
            if job.weight_decay is not None:
                hyper = replace(hyper, weight_decay=job.weight_decay)
            finite = self._step_fn(
                job.master, job.m, job.v, job.grad, lr=job.lr, step=job.step, hyper=hyper,
                grad_scale=job.grad_scale, out=job.out, **job.extra,
            )  # fmt: skip
            job.finite = finite is not False
            if on_done is not None:
                on_done(job)
        except BaseException as err:  # noqa: BLE001 - every failure must reach the caller
            self._record_error(err, job.key)
            fut.set_exception(err)
        else:
            fut.set_result(job)

    def _record_error(self, err: BaseException, key: Hashable) -> None:
        """Keep the first failure; wake waiters so they raise it."""
        with self._cond:
            if self._error is None:
                self._error, self._error_key = err, key
            self._cond.notify_all()
