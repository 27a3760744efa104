"""The Adam worker: results, order, error propagation, shutdown; every wait has a timeout."""

from __future__ import annotations

import platform
import threading
import time

import numba
import pytest
import torch

from fuyou.errors import ConfigError
from fuyou.optim import AdamJob, AdamWHyper, AdamWorker, AdamWorkerError, adamw_step

from .helpers import assert_bits_equal, make_grads, make_state

HYPER = AdamWHyper(weight_decay=0.01)
T = 10.0  # seconds: generous timeouts so a bug fails the test instead of hanging it
GATE_LR, BAD_LR = 0.25, 0.5  # magic learning rates the fake step function reacts to


class Fake:
    """A step function that blocks on ``gate`` when lr == GATE_LR and raises when lr == BAD_LR."""

    def __init__(self) -> None:
        self.gate, self.started = threading.Event(), threading.Event()
        self.calls: list[float] = []

    def __call__(self, master, m, v, grad, *, lr, step, **_):  # type: ignore[no-untyped-def]
        self.calls.append(lr)
        if lr == GATE_LR:
            self.started.set()
            assert self.gate.wait(T), "test gate never opened"
        if lr == BAD_LR:
            raise ValueError("boom")
        master.add_(1.0)


def thread_name() -> str:
    return threading.current_thread().name


def job(key: int, lr: float = 1e-3, n: int = 8) -> AdamJob:
    z = torch.zeros
    return AdamJob(key, z(n), z(n), z(n), torch.ones(n), lr=lr, step=1)


def layer_jobs(n_layers: int, n: int, step: int) -> list[AdamJob]:
    jobs = []
    for i in range(n_layers):
        master, m, v = make_state(n, seed=i)
        grad = make_grads(n, 1, seed=100 + i)[0].to(torch.bfloat16)
        out = torch.empty(n, dtype=torch.bfloat16)
        jobs.append(AdamJob(i, master, m, v, grad, lr=1e-3 * (i + 1), step=step, out=out))
    return jobs


def test_results_equal_direct_calls() -> None:
    jobs, direct = layer_jobs(6, 5000, step=1), layer_jobs(6, 5000, step=1)
    with AdamWorker(HYPER, num_threads=1) as w:
        futures = [w.submit(j) for j in jobs]
        w.wait(timeout=T)
    for fut, j, d in zip(futures, jobs, direct):
        assert fut.result(timeout=0) is j
        adamw_step(d.master, d.m, d.v, d.grad, lr=d.lr, step=d.step, hyper=HYPER, out=d.out)
        for name in ("master", "m", "v", "out"):
            assert_bits_equal(getattr(j, name), getattr(d, name), f"layer {j.key} {name}")


def test_jobs_finish_in_submission_order_on_the_worker_thread() -> None:
    seen: list[tuple[int, str]] = []
    with AdamWorker(HYPER, step_fn=Fake(), name="adam-test") as w:
        for k in range(50):
            w.submit(job(k), on_done=lambda j: seen.append((j.key, thread_name())))
    assert seen == [(k, "adam-test") for k in range(50)]


def test_failure_reaches_future_submit_wait_and_close() -> None:
    fake = Fake()
    w = AdamWorker(HYPER, step_fn=fake)
    futs = [w.submit(j) for j in (job(0, lr=GATE_LR), job(1), job(2, lr=BAD_LR), job(3))]
    fake.gate.set()
    assert isinstance(futs[2].exception(timeout=T), ValueError)
    assert futs[0].result(timeout=T).master[0] == 1.0 and futs[1].result(timeout=T)
    with pytest.raises(AdamWorkerError, match="skipped"):
        futs[3].result(timeout=T)
    for call in (lambda: w.submit(job(4)), lambda: w.wait(timeout=T), lambda: w.close(timeout=T)):
        with pytest.raises(AdamWorkerError, match="job 2 failed") as err:
            call()
        assert isinstance(err.value.__cause__, ValueError)
    assert fake.calls == [GATE_LR, 1e-3, BAD_LR]  # job 3 never ran on inconsistent state


def test_failing_on_done_callback_fails_the_job() -> None:
    def bad_callback(j: AdamJob) -> None:
        raise KeyError("writer gone")

    with pytest.raises(AdamWorkerError, match="writer gone"):
        with AdamWorker(HYPER, step_fn=Fake()) as w:
            fut = w.submit(job(0), on_done=bad_callback)
            assert isinstance(fut.exception(timeout=T), KeyError)


def test_close_finishes_pending_jobs() -> None:
    fake = Fake()
    w = AdamWorker(HYPER, step_fn=fake)
    futs = [w.submit(job(0, lr=GATE_LR))] + [w.submit(job(k)) for k in range(1, 5)]
    threading.Timer(0.1, fake.gate.set).start()
    w.close(timeout=T)
    assert all(f.done() and f.result().master[0] == 1.0 for f in futs)
    with pytest.raises(AdamWorkerError, match="closed"):
        w.submit(job(9))
    w.close(timeout=T)  # idempotent


def test_close_can_cancel_pending_jobs() -> None:
    fake = Fake()
    w = AdamWorker(HYPER, step_fn=fake)
    futs = [w.submit(job(0, lr=GATE_LR))] + [w.submit(job(k)) for k in range(1, 5)]
    assert fake.started.wait(T)
    threading.Timer(0.1, fake.gate.set).start()
    w.close(cancel_pending=True, timeout=T)
    assert futs[0].result(timeout=0).master[0] == 1.0
    assert all(f.cancelled() for f in futs[1:])
    assert w.pending == 0 and fake.calls == [GATE_LR]


def test_timeouts_raise_instead_of_hanging() -> None:
    fake = Fake()
    w = AdamWorker(HYPER, step_fn=fake)
    w.submit(job(0, lr=GATE_LR))
    t0 = time.monotonic()
    with pytest.raises(AdamWorkerError, match="pending after"):
        w.wait(timeout=0.1)
    with pytest.raises(AdamWorkerError, match="still busy"):
        w.close(timeout=0.1)
    assert time.monotonic() - t0 < T / 2
    fake.gate.set()
    w.close(timeout=T)


def test_exception_in_with_body_is_not_masked() -> None:
    fake = Fake()
    with pytest.raises(RuntimeError, match="training loop"):
        with AdamWorker(HYPER, step_fn=fake) as w:
            w.submit(job(0, lr=BAD_LR))
            raise RuntimeError("training loop broke")
    assert not w._thread.is_alive()


def test_bad_arguments_are_refused_up_front() -> None:
    with pytest.raises(ConfigError, match="num_threads"):
        AdamWorker(HYPER, num_threads=0)
    bad = job(0)
    bad.step = 0
    with AdamWorker(HYPER, step_fn=Fake()) as w:
        with pytest.raises(ConfigError, match="step=0"):
            w.submit(bad)
        assert w.pending == 0


def test_kernel_calls_from_two_threads_are_serialised() -> None:
    """The main thread may call the kernel while the worker does (KERNEL_LOCK): same bits."""
    jobs, direct = layer_jobs(4, 200_000, step=2), layer_jobs(4, 200_000, step=2)
    with AdamWorker(HYPER) as w:
        for j in jobs:
            w.submit(j)
        for d in direct:
            adamw_step(d.master, d.m, d.v, d.grad, lr=d.lr, step=d.step, hyper=HYPER, out=d.out)
        w.wait(timeout=T)
    for j, d in zip(jobs, direct):
        assert_bits_equal(j.master, d.master)


def test_worker_start_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import fuyou.optim.worker as worker_module

    def broken(n: int) -> None:
        raise RuntimeError("no threads for you")

    monkeypatch.setattr(worker_module.numba, "set_num_threads", broken)
    w = AdamWorker(HYPER, num_threads=1, step_fn=Fake())
    with pytest.raises(AdamWorkerError, match="worker start") as err:
        w.submit(job(0))
        w.wait(timeout=T)
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(AdamWorkerError):
        w.close(timeout=T)


def test_close_from_the_worker_thread_fails_that_job_not_the_process() -> None:
    w = AdamWorker(HYPER, step_fn=Fake())
    fut = w.submit(job(0), on_done=lambda j: w.close())
    assert isinstance(fut.exception(timeout=T), AdamWorkerError)
    with pytest.raises(AdamWorkerError, match="worker thread"):
        w.close(timeout=T)


def test_per_job_weight_decay_overrides_the_workers() -> None:
    """E.g. no decay for biases and norm weights: the job's weight_decay wins, and is validated."""
    (a,), (b,) = layer_jobs(1, 3000, step=1), layer_jobs(1, 3000, step=1)
    a.weight_decay = 0.0
    with AdamWorker(AdamWHyper(weight_decay=0.5)) as w:
        w.submit(a).result(timeout=T)
        b.weight_decay = -1.0
        with pytest.raises(ConfigError, match="weight_decay=-1.0"):
            w.submit(b)
    adamw_step(b.master, b.m, b.v, b.grad, lr=b.lr, step=1, hyper=AdamWHyper(), out=b.out)
    assert_bits_equal(a.master, b.master, "master with weight_decay=0")


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs ≥ 2 torch threads")
def test_the_worker_thread_makes_no_openmp_team_of_its_own() -> None:
    """A thread with an OpenMP team beside the training thread's makes libgomp stop spinning in every team
    (``fuyou.device.host_threads``): the worker's torch ops (its callbacks' copies) run serially."""
    seen: list[int] = []

    def on_done(j: AdamJob) -> None:
        torch.ones(1 << 22).mul_(2.0).sum()  # large enough for ATen to run in parallel where it may
        seen.append(torch.get_num_threads())

    with AdamWorker(HYPER, name="adam-test") as w:
        w.submit(job(0), on_done=on_done)
        w.wait(timeout=T)
    assert seen == [1] and torch.get_num_threads() >= 2  # the main thread keeps its team


@pytest.mark.skipif(platform.machine() != "x86_64", reason="tbb has wheels for x86-64 only")
def test_numba_runs_the_kernels_on_tbb_not_openmp() -> None:
    """The ``tbb`` dependency is what numba loads (its default order prefers it): under ``omp`` the Adam
    thread's kernel team comes from torch's libgomp and slows the training thread (host_threads)."""
    master, m, v = make_state(1 << 16, seed=0)
    with AdamWorker(HYPER) as w:  # numba's default thread count: a parallel launch picks the layer
        w.submit(AdamJob(0, master, m, v, make_grads(1 << 16, 1, seed=1)[0], lr=1e-3, step=1))
        w.wait(timeout=T)
    assert numba.threading_layer() == "tbb"
