"""The asynchronous CPU backend (``fuyou/device/cpu_async.py``): GPU-like ordering and poisoned memory."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from fuyou.device import CPUBackend, cpu_arena, get_backend
from fuyou.device.cpu_async import ENV, SEED_ENV, AsyncCPUBackend, OrderingHazard
from fuyou.errors import ConfigError
from fuyou.transfer.host_pool import HostBufferPool

MODES = [pytest.param(True, id="arena"), pytest.param(False, id="resize")]


def _arena_or_skip(arena: bool) -> None:
    if arena and not cpu_arena.SUPPORTED:
        pytest.skip("this torch build lacks storage use counts / data-pointer swaps")


def _hold(stream) -> threading.Event:
    """Hold ``stream``'s later work back until the returned event is set (a deterministic delay)."""
    gate = threading.Event()
    stream.put(gate.wait)
    return gate


def _ready(b, n: int, value: float, what: str = "x") -> torch.Tensor:
    """A device tensor compute has filled (and the streams may use: compute recorded after it)."""
    t = b.device_empty((n,), torch.float32, what)
    t.fill_(value)
    return t


def test_plain_cpu_copy_is_done_when_it_returns():
    b = CPUBackend()
    src, dst = torch.arange(8.0), torch.zeros(8)
    ev = b.copy(dst, src, b.new_stream())
    assert ev.query() and torch.equal(dst, src)


@pytest.mark.parametrize("arena", MODES)
def test_event_is_not_complete_before_its_copy(arena):
    _arena_or_skip(arena)
    b = AsyncCPUBackend(max_delay=0.05, seed=1, arena=arena)
    s = b.new_stream()
    host = b.host_empty(4096).view(torch.float32)
    host.fill_(3.0)
    dev = b.device_empty((1024,), torch.float32, "weights")
    b.record().wait(s)  # the stream follows compute (which handed out dev)
    gate = _hold(s)
    ev = b.copy(dev, host, s)
    assert not ev.query(), "an event completes only once its copy has run"
    assert dev.isnan().all(), "fresh device memory reads as poison until the copy lands"
    gate.set()
    ev.wait()  # the host thread blocks until the copy has run (after its random delay)
    assert ev.query() and torch.equal(dev, host)


def test_query_is_honest_and_wait_blocks_until_the_work_ran():
    b = AsyncCPUBackend(max_delay=0.0)
    s, held = b.new_stream(), b.new_stream()
    gate = _hold(held)
    b.record(held).wait(s)  # s waits for held, which waits for the gate
    ev = b.record(s)
    waiter = threading.Thread(target=ev.wait)
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive() and not ev.query(), "wait() blocks until the event's work has run"
    gate.set()
    waiter.join(5)
    assert not waiter.is_alive() and ev.query()


@pytest.mark.parametrize("arena", MODES)
def test_wait_orders_one_stream_after_another(arena):
    """s2 copies what s1 copied: with the event wait the result is always right; without it the
    random delays let s2 overtake s1 (so the check has teeth)."""
    _arena_or_skip(arena)
    b = AsyncCPUBackend(max_delay=0.004, seed=7, arena=arena)
    s1, s2 = b.new_stream(), b.new_stream()
    host_in, host_out = b.host_empty(256).view(torch.float32), b.host_empty(256).view(torch.float32)
    wrong = 0
    for i in range(40):
        host_in.fill_(float(i))
        dev = b.device_empty((64,), torch.float32, "relay")
        b.record().wait(s1)
        b.record().wait(s2)
        b.copy(dev, host_in, s1)
        if i % 2 == 0:
            b.record(s1).wait(s2)  # s2's next copy starts after s1's
        done = b.copy(host_out, dev, s2)
        b.keep_alive(dev, s2)
        done.wait()
        b.synchronize()
        if i % 2 == 0:
            assert torch.equal(host_out, host_in), f"iteration {i}: the waited copy saw stale data"
        else:
            wrong += not torch.equal(host_out, host_in)
    assert wrong > 0, "without the wait, s2 never overtook s1: the delays are not random enough"


@pytest.mark.parametrize("arena", MODES)
def test_freed_device_memory_is_poisoned(arena):
    _arena_or_skip(arena)
    b = AsyncCPUBackend(capacity=1 << 20, arena=arena)
    w = _ready(b, 1024, 1.0, "w")
    view = w[10:20]
    b.free_storage(w)
    alias = b.restore_storage(w, 4096, "w again")
    assert alias.numel() == 4096 and view.isnan().all(), "restored memory is poison until refilled"
    assert b.memory().allocated == 4096
    del w, view, alias
    gc.collect()
    assert b.memory().allocated == 0


def test_dropped_device_memory_is_poisoned_before_reuse():
    _arena_or_skip(True)
    b = AsyncCPUBackend()
    t = _ready(b, 1024, 5.0)
    ptr = t.data_ptr()
    del t
    again = b.device_empty((1024,), torch.float32, "same size")
    assert again.data_ptr() == ptr and again.isnan().all(), "a reused block comes back poisoned"


def test_released_host_buffer_is_poisoned_and_a_copy_still_reading_it_sees_nan():
    b = AsyncCPUBackend(seed=3)
    pool = HostBufferPool(b, budget=1 << 20)
    pool.reserve("w", 4096, 1)
    buf = pool.acquire("w")
    buf.view(torch.float32, 1024).fill_(2.0)
    s = b.new_stream()
    dev = b.device_empty((1024,), torch.float32, "w")
    b.record().wait(s)
    gate = _hold(s)
    ev = b.copy(dev, buf.view(torch.float32, 1024), s)
    pool.release(buf)  # a bug: released before the copy ran (the copy is still queued)
    assert buf.view(torch.float32, 1024).isnan().all(), "released host buffers are poisoned"
    gate.set()
    ev.wait()
    assert dev.isnan().all(), "the late copy read the poison, not the data"


@pytest.mark.parametrize("arena", MODES)
def test_device_memory_dropped_under_a_queued_copy_is_poisoned_unless_kept_alive(arena):
    _arena_or_skip(arena)
    for keep in (False, True):
        b = AsyncCPUBackend(seed=5, arena=arena)
        s = b.new_stream()
        out = b.host_empty(4096).view(torch.float32)
        grad = _ready(b, 1024, 7.0, "gradients")
        b.record().wait(s)
        gate = _hold(s)
        ev = b.copy(out, grad, s)
        if keep:
            b.keep_alive(grad, s)
        del grad  # the caller frees the gradient while the copy is queued
        assert b.memory().allocated == 0, "dropped memory is refunded at once (as CUDA counts it)"
        b.device_empty((1024,), torch.float32, "the next gradient").fill_(0.0)
        gate.set()
        ev.wait()
        if keep:
            assert (out == 7.0).all(), "keep_alive kept the memory from reuse until the copy ran"
        else:
            assert not (out == 7.0).all(), "the copy read memory given back: poison or its next user"
        b.synchronize()
        gc.collect()
        assert b.memory().allocated == 0


@pytest.mark.parametrize("arena", MODES)
def test_a_copy_that_does_not_wait_for_compute_is_an_ordering_hazard(arena):
    _arena_or_skip(arena)
    b = AsyncCPUBackend(arena=arena)
    s = b.new_stream()
    host = b.host_empty(4096).view(torch.float32)
    b.record().wait(s)
    dev = b.device_empty((1024,), torch.float32, "gradients of block 3")  # handed out after the wait
    with pytest.raises(OrderingHazard, match="gradients of block 3.*record\\(\\).wait\\(stream\\)"):
        b.copy(host, dev, s)
    other = b.new_stream()
    b.record().wait(other)
    b.record(other).wait(s)  # ordered after compute through another stream's event: fine
    b.copy(host, dev, s).wait()
    b.copy(host, host.clone(), s).wait()  # host memory only: nothing to order
    w = b.device_empty((1024,), torch.float32, "w")
    b.record().wait(s)
    b.free_storage(w)
    alias = b.restore_storage(w, 4096, "weights of block 2")  # restored after the wait
    with pytest.raises(OrderingHazard, match="weights of block 2"):
        b.copy(alias, host.view(torch.uint8), s)


def test_on_runs_after_the_streams_queued_copies_and_synchronize_drains_all():
    b = AsyncCPUBackend(max_delay=0.02, seed=2)
    streams = [b.new_stream() for _ in range(3)]
    outs = [torch.zeros(16) for _ in streams]
    for s, o in zip(streams, outs):
        b.copy(o, torch.full((16,), 4.0), s)
    with b.on(streams[0]):
        assert (outs[0] == 4.0).all()
    b.synchronize()
    assert all((o == 4.0).all() for o in outs)


def test_delays_are_seeded():
    draws = []
    for _ in range(2):
        b = AsyncCPUBackend(seed=11)
        draws.append([b._rng.uniform(0, 1) for _ in range(5)])
    assert draws[0] == draws[1]


def test_stream_threads_end_with_their_streams():
    b = AsyncCPUBackend()
    before = set(threading.enumerate())
    s = b.new_stream()
    b.copy(torch.zeros(4), torch.ones(4), s).wait()
    (worker,) = set(threading.enumerate()) - before
    del s
    gc.collect()
    worker.join(5)
    assert not worker.is_alive()


def test_get_backend_reads_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "resize")
    monkeypatch.setenv(SEED_ENV, "42")
    b = get_backend("cpu", capacity=1 << 20)
    assert isinstance(b, AsyncCPUBackend) and b._arena is None and b.seed == 42 and b.name == "cpu"
    if cpu_arena.SUPPORTED:
        monkeypatch.setenv(ENV, "1")
        b = get_backend("cpu")
        assert isinstance(b, AsyncCPUBackend) and b._arena is not None
    monkeypatch.setenv(ENV, "0")
    assert type(get_backend("cpu")) is CPUBackend
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ConfigError, match=ENV):
        get_backend("cpu")
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setenv(SEED_ENV, "x")
    with pytest.raises(ConfigError, match=SEED_ENV):
        get_backend("cpu")


@pytest.mark.parametrize("arena", MODES)
def test_memory_handed_out_for_a_stream_needs_no_compute_wait_but_must_be_kept_for_compute(arena):
    """The FSDP pattern: memory from the copy stream's pool is filled there without waiting for
    compute; compute reading it must be declared (keep_alive), or the stream's next allocation raises."""
    _arena_or_skip(arena)
    b = AsyncCPUBackend(arena=arena)
    s = b.new_stream()
    host = b.host_empty(4096).view(torch.float32)
    host.fill_(2.0)
    w = b.device_empty((1024,), torch.float32, "weights of block 1", stream=s)
    b.copy(w, host, s).wait()  # no record().wait(s) needed: the stream owns the memory
    assert torch.equal(w, host)
    b.keep_alive(w, b.current_stream())  # compute reads it
    v = b.device_empty((1024,), torch.float32, "weights of block 2", stream=s)
    with pytest.raises(OrderingHazard, match="weights of block 2.*never kept for compute"):
        b.device_empty((1024,), torch.float32, "weights of block 3", stream=s)
    b.keep_alive(v, b.current_stream())
    b.free_storage(w)
    alias = b.restore_storage(w, 4096, "weights of block 1 again", stream=s)
    b.copy(alias, host.view(torch.uint8), s).wait()
    with pytest.raises(OrderingHazard, match="block 1 again"):
        b.device_empty((1024,), torch.float32, "weights of block 4", stream=s)
