"""The CPU backend counts what a GPU's allocator would: every storage compute allocates."""

from __future__ import annotations

import gc

import pytest
import torch

from fuyou.device.cpu import CPUBackend
from fuyou.device.cpu_async import AsyncCPUBackend
from fuyou.errors import DeviceMemoryError

MiB = 1 << 20


@pytest.fixture(params=["plain", "async-arena", "async-resize"])
def backend(request):
    if request.param == "plain":
        return CPUBackend(64 * MiB)
    return AsyncCPUBackend(64 * MiB, arena=request.param == "async-arena", max_delay=0.0)


def allocated(be) -> int:
    gc.collect()
    return be.memory().allocated


def test_new_storages_count_views_and_in_place_ops_do_not(backend):
    base = allocated(backend)
    with backend.counting("a test"):
        a = torch.ones(1024, 256)  # 1 MiB
        v = a.view(-1)[: 1024 * 128]  # a view: no new memory
        a.add_(1.0)  # in place: none
        b = a * 2  # 1 MiB more
    assert allocated(backend) - base == 2 * MiB
    assert backend.memory().peak - base >= 2 * MiB
    del a, v
    assert allocated(backend) - base == MiB  # freed storages are refunded
    del b
    assert allocated(backend) == base


def test_backward_allocations_count_and_host_staging_does_not(backend):
    base = allocated(backend)
    w = torch.randn(512, 512, requires_grad=True)  # made outside: not the device's
    assert allocated(backend) == base
    with backend.counting("a test"):
        staging = backend.host_staging((512, 512), torch.float32)  # host memory
        assert allocated(backend) == base
        loss = (w @ w).relu().sum()  # the relu output (1 MiB) is kept for backward
        grad_before = allocated(backend)
        loss.backward()
    assert grad_before - base >= MiB
    assert w.grad is not None
    del loss, staging
    assert allocated(backend) - base == MiB  # the gradient lives on: 512 × 512 fp32
    w.grad = None
    assert allocated(backend) == base


def test_passing_the_capacity_raises_the_one_line_error_naming_the_op():
    be = CPUBackend(3 * MiB)
    keep = be.device_empty((MiB // 2,), torch.float32, "a buffer")  # 2 MiB through the engine's path
    with pytest.raises(
        DeviceMemoryError, match=r"allocating 2\.0 MiB for ones\S* in forward of layer\.7 .*--gpu-memory"
    ):
        with be.counting("forward of layer.7"):
            _ = torch.ones(MiB // 2) * 2
    del keep
    assert allocated(be) == 0


def test_a_freed_engine_buffer_is_not_counted_at_the_next_peak_nor_refused(backend):
    """Engine buffers (``device_empty``) are refunded lazily; compute reaching a new peak counts what
    was freed first, as CUDA's allocator would: no stale bytes in the peak, no out-of-memory error
    that a GPU would not raise."""
    base = allocated(backend)
    w = backend.device_empty((40 * MiB // 4,), torch.float32, "a layer's weights")  # 40 MiB of 64
    del w  # freed, not yet noticed by the arena
    with backend.counting("a test"):
        big = torch.ones(40 * MiB // 4)  # would pass 64 MiB if the freed buffer still counted
    assert backend.memory().peak - base <= 41 * MiB
    del big
