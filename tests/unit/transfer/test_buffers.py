import threading
import time

import pytest
import torch

from fuyou.device import CPUBackend
from fuyou.errors import ConfigError, FuyouError, HostMemoryError
from fuyou.transfer.host_pool import HostBufferPool


def test_reserve_within_budget_and_refuse_past_it():
    pool = HostBufferPool(CPUBackend(), budget=3 * 8192)
    pool.reserve("weights", 5000, 2)  # rounds to 2 × 8 KiB
    with pytest.raises(HostMemoryError, match="weights.*grads.*host budget is 24.0 KiB.*--cpu-memory"):
        pool.reserve("grads", 4097, 2)
    pool.reserve("grads", 4096, 2)
    assert pool.reserved == 3 * 8192
    with pytest.raises(ConfigError):
        pool.reserve("grads", 4096, 1)


def test_budget_error_groups_a_family_of_classes_into_one_entry():
    pool = HostBufferPool(CPUBackend(), budget=40 * 4096)
    for b in range(30):
        pool.reserve(f"park/{b}", 4096, 1)
    with pytest.raises(HostMemoryError) as e:
        pool.reserve("weights", 3 * 4096, 4)
    msg = str(e.value)
    assert "30 × 4.0 KiB park" in msg and "park/" not in msg and "4 × 12.0 KiB weights" in msg
    for way in ("--cpu-memory", "--prefetch-depth", "SSD", "--max-grad-norm 0"):
        assert way in msg


def test_buffers_are_preallocated_and_reused():
    pool = HostBufferPool(CPUBackend(), budget=1 << 20)
    pool.reserve("w", 4096 * 3 + 1, 2)
    a, b = pool.acquire("w"), pool.acquire("w")
    assert a.data.data_ptr() != b.data.data_ptr() and a.nbytes == 4096 * 3 + 1
    ptr = a.data.data_ptr()
    pool.release(a)
    assert pool.acquire("w").data.data_ptr() == ptr
    x = b.view(torch.float32, 3, offset=4096)
    x[:] = 1.5
    assert b.data[4096:4108].view(torch.float32).tolist() == [1.5] * 3
    with pytest.raises(ConfigError):
        b.view(torch.float32, 3, offset=2)
    with pytest.raises(ConfigError):
        b.view(torch.float32, 4096, offset=0)


def test_acquire_blocks_until_release_and_times_out():
    pool = HostBufferPool(CPUBackend(), budget=1 << 20)
    pool.reserve("g", 4096, 1)
    held = pool.acquire("g")
    with pytest.raises(FuyouError, match="no free host buffer"):
        pool.acquire("g", timeout=0.05)
    threading.Timer(0.1, pool.release, args=(held,)).start()
    t0 = time.perf_counter()
    again = pool.acquire("g", timeout=5)
    assert again is held and time.perf_counter() - t0 >= 0.05


def test_double_release_and_unknown_class():
    pool = HostBufferPool(CPUBackend(), budget=1 << 20)
    pool.reserve("g", 4096, 2)
    b = pool.acquire("g")
    pool.release(b)
    with pytest.raises(ConfigError, match="released twice"):
        pool.release(b)
    with pytest.raises(ConfigError, match="reserve it first"):
        pool.acquire("nope")


def test_transient_charges_count_against_the_budget():
    pool = HostBufferPool(CPUBackend(), budget=64 << 10)
    pool.reserve("w", 4096, 8)
    pool.charge(16 << 10, "activations of layer.3")
    with pytest.raises(HostMemoryError, match="activations of layer.4.*swap activations to SSD"):
        pool.charge((16 << 10) + 1, "activations of layer.4")
    pool.refund(16 << 10)
    pool.charge(32 << 10, "activations of layer.4")
    assert pool.reserved == 64 << 10 and pool.peak == 64 << 10
