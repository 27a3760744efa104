"""Host buffers and gradient copies under the asynchronous CPU backend (``fuyou/device/cpu_async.py``)."""

from __future__ import annotations

import gc
import threading
from types import SimpleNamespace

import torch

from fuyou.device import CPUBackend
from fuyou.device.cpu_async import AsyncCPUBackend
from fuyou.schedule.sizing import GRADS
from fuyou.timeline import Timeline
from fuyou.transfer.gradients import GradientOffload
from fuyou.transfer.host_pool import HostBufferPool


def test_released_buffers_are_poisoned_only_by_the_async_backend():
    for backend, poisoned in ((CPUBackend(), False), (AsyncCPUBackend(), True)):
        pool = HostBufferPool(backend, budget=1 << 20)
        pool.reserve("w", 4096, 1)
        buf = pool.acquire("w")
        buf.view(torch.float32, 1024).fill_(1.0)
        pool.release(buf)
        assert buf.view(torch.float32, 1024).isnan().all() == poisoned


def test_offloaded_gradient_lands_after_its_event_though_the_caller_dropped_it():
    """The offload's copy is queued (held back here); the caller drops the device gradient and the
    device allocates again (memory reuse); keep_alive keeps the gradient's memory for the copy."""
    b = AsyncCPUBackend(seed=4)
    pool = HostBufferPool(b, budget=1 << 20)
    pool.reserve(GRADS, 4096, 2)
    layout = SimpleNamespace(blocks=[SimpleNamespace(name="block 0")])
    stream = b.new_stream()
    off = GradientOffload(b, pool, layout, Timeline(), stream)
    grad = b.device_empty((1024,), torch.float32, "gradients of block 0")
    grad.copy_(torch.arange(1024.0))
    gate = threading.Event()
    stream.put(gate.wait)  # hold the stream: the copy cannot run yet
    buf, ready = off.offload(0, grad)
    assert not ready.query()
    del grad
    gc.collect()
    assert b.memory().allocated == 0, "the dropped gradient is refunded at once"
    b.device_empty((1024,), torch.float32, "the next block's gradients").fill_(-1.0)
    gate.set()
    ready.wait()
    assert torch.equal(buf.view(torch.float32, 1024), torch.arange(1024.0))
