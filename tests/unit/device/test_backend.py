import gc

import pytest
import torch

from fuyou.device import HOST_ALIGN, CPUBackend, get_backend
from fuyou.errors import ConfigError, DeviceMemoryError


def test_fake_capacity_is_enforced_and_names_what():
    b = CPUBackend(capacity=1 << 20)
    keep = b.device_empty((128, 1024), torch.float32, "layer 0 weights")  # 512 KiB
    with pytest.raises(DeviceMemoryError, match="layer 1 weights.*1.0 MiB capacity.*--gpu-memory"):
        b.device_empty((160, 1024), torch.float32, "layer 1 weights")  # 640 KiB more
    assert b.memory().allocated == 512 * 1024
    del keep


def test_accounting_is_exact_with_views_and_frees():
    b = CPUBackend(capacity=10 << 20)
    t = b.device_empty((1000,), torch.bfloat16)
    v = t[10:20].view(torch.int16)
    del t
    gc.collect()
    assert b.memory().allocated == 2000, "a live view keeps the storage (and its charge) alive"
    del v
    gc.collect()
    m = b.memory()
    assert (m.allocated, m.peak, m.capacity) == (0, 2000, 10 << 20)
    b.device_empty((5 << 18,), torch.float32)  # 5 MiB fits again once freed


def test_failed_allocation_leaves_no_charge():
    b = CPUBackend(capacity=100)
    with pytest.raises(DeviceMemoryError):
        b.device_empty((26,), torch.float32)
    assert b.memory().allocated == 0


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, (1 << 20) + 3])
def test_host_buffers_are_page_aligned_exact_size(n):
    t = CPUBackend().host_empty(n)
    assert t.numel() == n and t.dtype == torch.uint8 and t.data_ptr() % HOST_ALIGN == 0


def test_cpu_streams_and_events_are_null_but_usable():
    b = CPUBackend()
    s = b.new_stream()
    with b.on(s):
        x = torch.ones(4) * 2
    ev = b.record(s)
    ev.wait()
    ev.wait(s)
    assert ev.query() and x.sum().item() == 8
    b.keep_alive(x, s)
    b.synchronize()


def test_get_backend():
    assert get_backend("cpu", capacity=123).memory().capacity == 123
    if not torch.cuda.is_available():
        assert get_backend("auto").name == "cpu"
    with pytest.raises(ConfigError, match="--device"):
        get_backend("tpu")


def test_free_and_restore_storage_keeps_views_and_accounting():
    b = CPUBackend(capacity=1 << 20)
    buf = b.device_empty((4096,), torch.uint8, "w")
    view = buf[64:128].view(torch.float32)
    version = view._version
    b.free_storage(buf)
    assert b.memory().allocated == 0 and view.shape == (16,)
    filler = b.device_empty((1 << 20,), torch.uint8, "fills the device while w is freed")
    with pytest.raises(DeviceMemoryError, match="restore-me"):
        b.restore_storage(buf, 4096, "restore-me")
    del filler
    gc.collect()
    alias = b.restore_storage(buf, 4096, "w again")
    alias[64:128].view(torch.float32).fill_(3.0)
    assert view.sum().item() == 48.0 and view._version == version, "restore must not bump autograd's version"
    assert b.memory().allocated == 4096
    del buf, view, alias
    gc.collect()
    assert b.memory().allocated == 0


def test_arena_reuses_freed_blocks_without_new_pages():
    from fuyou.device import cpu_arena

    if not cpu_arena.SUPPORTED:
        pytest.skip("this torch build lacks storage use counts / data-pointer swaps")
    b = CPUBackend(capacity=64 << 20)
    t = b.device_empty((1 << 20,), torch.float32, "grads")
    ptr = t.data_ptr()
    del t
    again = b.device_empty((1 << 20,), torch.float32, "grads again")
    assert again.data_ptr() == ptr, "a freed block of the same size is reused"
    b.free_storage(again)
    other = b.device_empty((1 << 19,), torch.float64, "same bytes, other dtype")
    assert other.data_ptr() == ptr and b.memory().allocated == 4 << 20
    w = b.device_empty((1 << 22,), torch.uint8, "w")
    wptr = w.data_ptr()
    b.free_storage(w)
    alias = b.restore_storage(w, 4 << 20, "w again")
    assert alias.data_ptr() == wptr, "restore takes the block its own free put in the cache"
    del other, again, w, alias
    gc.collect()
    m = b.memory()
    assert (m.allocated, m.peak) == (0, 8 << 20)
    assert b._arena.stats()[2] <= cpu_arena.CACHE_FACTOR * m.peak, "the cache is bounded by the peak of live bytes"


def test_arena_cache_is_trimmed_to_a_multiple_of_the_peak_of_live_bytes():
    from fuyou.device import cpu_arena

    if not cpu_arena.SUPPORTED:
        pytest.skip("this torch build lacks storage use counts / data-pointer swaps")
    b = CPUBackend()
    for n in range(1, 40):  # every size more than 1/16 apart: nothing can be reused
        del_me = b.device_empty((int(1000 * 1.1**n),), torch.uint8)
        del del_me
    allocated, peak, cached = b._arena.stats()
    assert allocated == 0 and peak == int(1000 * 1.1**39) and 0 < cached <= cpu_arena.CACHE_FACTOR * peak


def test_arena_serves_a_slightly_larger_block_and_charges_it():
    from fuyou.device import cpu_arena

    if not cpu_arena.SUPPORTED:
        pytest.skip("this torch build lacks storage use counts / data-pointer swaps")
    b = CPUBackend(capacity=1 << 20)
    t = b.device_empty((1040,), torch.uint8)
    ptr = t.data_ptr()
    del t
    small = b.device_empty((1000,), torch.uint8)  # within 1/16: the cached 1040-byte block
    assert small.data_ptr() == ptr and b.memory().allocated == 1040
    del small
    big = b.device_empty((2000,), torch.uint8)  # too far from 1040: a new block
    assert big.data_ptr() != ptr and b.memory().allocated == 2000
