"""CUDA backend and kvikio engine on a real GPU (skipped without one)."""

import pytest
import torch

from fuyou.device import get_backend
from fuyou.errors import DeviceMemoryError

pytestmark = pytest.mark.gpu


def test_pinned_exact_size_aligned_host_buffers():
    b = get_backend("cuda")
    t = b.host_empty((1 << 20) + 3)
    assert t.numel() == (1 << 20) + 3 and t.data_ptr() % 4096 == 0 and t.is_pinned()


def test_side_stream_copy_ordered_by_events():
    """Race bait: a wide, low-FLOP copy on a side stream; without the event wait the sum is wrong."""
    b = get_backend("cuda")
    host = b.host_empty(256 << 20).view(torch.float32)
    host.fill_(1.0)
    dev = b.device_empty(host.shape, torch.float32, "copy target")
    dev.zero_()
    s = b.new_stream()
    with b.on(s):
        dev.copy_(host, non_blocking=True)
        b.keep_alive(dev, s)
    ev = b.record(s)
    ev.wait(torch.cuda.current_stream())  # compute stream waits for the copy
    assert dev.sum().item() == host.numel()
    ev.wait()
    assert ev.query()


def test_backend_copy_runs_on_the_stream_and_its_event_orders_compute():
    """``Backend.copy`` (the data path's copies): issued on a side stream, complete once its event is."""
    b = get_backend("cuda")
    host = b.host_empty(256 << 20).view(torch.float32)
    host.fill_(1.0)
    dev = b.device_empty(host.shape, torch.float32, "copy target")
    dev.zero_()
    s = b.new_stream()
    b.record().wait(s)  # the side stream follows compute (which zeroed dev)
    ev = b.copy(dev, host, s)
    ev.wait(b.current_stream())
    assert dev.sum().item() == host.numel()
    back = b.host_empty(host.numel() * 4).view(torch.float32)
    b.record().wait(s)
    ev = b.copy(back, dev, s)
    b.keep_alive(dev, s)
    ev.wait()
    assert ev.query() and torch.equal(back, host)


def test_device_capacity_cap():
    b = get_backend("cuda", capacity=64 << 20)
    keep = b.device_empty((8 << 20,), torch.float32, "a")  # 32 MiB
    with pytest.raises(DeviceMemoryError, match="capacity"):
        b.device_empty((12 << 20,), torch.float32, "b")  # 48 MiB more
    del keep


def test_kvikio_store_round_trip(tmp_path):
    from fuyou.storage import ExtentSpec, TensorSpec, TensorStore
    from fuyou.storage.io_kvikio import kvikio_usable

    if not kvikio_usable():
        pytest.skip("kvikio not installed")
    exts = [ExtentSpec(f"e{n}", (TensorSpec("b", (n,), torch.uint8),)) for n in (1, 4095, 4097, (1 << 20) + 3)]
    b = get_backend("cuda")
    with TensorStore.create([str(tmp_path)], exts, io="kvikio") as st:
        assert st.io.name == "kvikio"
        for e in exts:
            n = e.nbytes
            src = b.host_empty(n)
            src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
            st.write(e.name, src).result()
            out = b.host_empty(n)
            st.read(e.name, out).result()
            assert torch.equal(out, src)


def test_kvikio_runs_with_a_thread_pool_and_o_direct(tmp_path):
    """kvikio's defaults (one thread, page-cache reads) would serialise the store's I/O: the backend
    sets a pool of at least the store's I/O threads, and O_DIRECT where the store uses it."""
    from fuyou.storage import ExtentSpec, TensorSpec, TensorStore
    from fuyou.storage.io_kvikio import _threads, kvikio_usable

    if not kvikio_usable():
        pytest.skip("kvikio not installed")
    import kvikio
    import kvikio.defaults

    exts = [ExtentSpec("e", (TensorSpec("b", (1 << 22,), torch.uint8),))]
    with TensorStore.create([str(tmp_path)], exts, io="kvikio") as st:
        src = get_backend("cuda").host_empty(1 << 22)
        st.write("e", src).result()
        st.read("e", src).result()
        assert _threads(kvikio) >= st.io.threads
        if st.direct[0] and hasattr(kvikio.defaults, "get"):
            assert kvikio.defaults.get("auto_direct_io_read") and kvikio.defaults.get("auto_direct_io_write")


def test_device_span_times_the_kernel_not_its_launch():
    """A matmul's launch returns in microseconds; its compute span (CUDA timing events, resolved at
    summary) must cover the kernel's run, as measured by synchronising around it."""
    import time

    from fuyou.timeline import Timeline

    b, tl = get_backend("cuda"), Timeline()
    x = torch.randn(8192, 8192, device="cuda")
    x @ x  # warm-up (cuBLAS handle, workspace)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with tl.device_span("compute", "matmul", b, None):
        for _ in range(4):
            x @ x
    launch = time.perf_counter() - t
    torch.cuda.synchronize()
    kernel = time.perf_counter() - t
    s = tl.summary(t - 1, time.perf_counter() + 1)
    (span,) = tl.spans
    assert span.t1 - span.t0 >= 0.5 * kernel > launch
    assert s["busy_s"]["compute"] <= kernel * 1.1 + 1e-3


def test_weights_allocated_for_the_copy_stream_need_no_compute_wait():
    """The FSDP pattern on a real allocator: memory from the copy stream's pool, marked as used by
    compute, is not handed to the copy stream again while compute queued before its release runs."""
    b = get_backend("cuda")
    s = b.new_stream()
    compute = b.current_stream()
    host = b.host_empty(64 << 20)
    host.fill_(1)
    torch.ones(8, device=b.device, dtype=torch.uint8).float().sum().item()  # kernels loaded (lazy loading) beforehand
    first = b.device_empty((64 << 20,), torch.uint8, "w0", stream=s)
    b.copy(first, host, s).wait(compute)
    b.keep_alive(first, compute)
    ptr = first.data_ptr()
    torch.cuda._sleep(2_000_000_000)  # compute busy for about a second, still "reading" first
    out = first.float().sum()
    del first
    assert not compute.query(), "compute finished before the test could ask for memory: the check would prove nothing"
    second = b.device_empty((64 << 20,), torch.uint8, "w1", stream=s)
    assert second.data_ptr() != ptr, "the copy stream got memory compute may still be reading"
    assert out.item() == 64 << 20


def test_aligned_staging_is_pinned_and_page_aligned():
    """Staging for activations read back from SSD (O_DIRECT) and then copied to the device."""
    b = get_backend("cuda")
    for n in (1, 4096 * 3 + 5, 64 << 20):
        t = b.host_staging_aligned(n)
        assert t.numel() == n and t.data_ptr() % 4096 == 0 and t.is_pinned()
