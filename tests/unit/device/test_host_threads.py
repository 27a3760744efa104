"""Data-moving worker threads make no OpenMP team of their own (``fuyou.device.host_threads``): with
more OpenMP threads than cores, libgomp's idle workers sleep at once and compute's parallel regions
wait for them to wake (a SmolLM2 layer 14.7 ms → 10.0 ms on 2 cores)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from fuyou.device.host_threads import serial_worker


def _tasks() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _run_workers(serial: bool, n: int = 4) -> int:
    """Native threads of this process while ``n`` worker threads that ran a parallel op are alive."""
    go, done = threading.Event(), threading.Barrier(n + 1)

    def worker() -> None:
        if serial:
            serial_worker()
        torch.ones(1 << 22).mul_(2.0).sum()  # large enough for ATen to run it in parallel
        done.wait()
        go.wait()

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    done.wait()
    count = _tasks()
    go.set()
    for t in threads:
        t.join()
    return count


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2, reason="needs ≥ 2 threads, Linux"
)
def test_serial_workers_make_no_openmp_team_and_leave_compute_threads_alone():
    torch.ones(1 << 22).mul_(2.0).sum()  # the main thread's own team exists before counting
    base = _tasks()
    teams = _run_workers(serial=False) - base
    serial = _run_workers(serial=True) - base
    assert serial == 4 < teams  # the workers alone; without: each brings OpenMP workers too
    assert torch.get_num_threads() >= 2
    seen: list[int] = []
    later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert seen == [torch.get_num_threads()]  # threads started later keep torch's setting


@pytest.mark.parametrize("nbytes", [1, 4 << 20, (13 << 20) + 4097, 40 << 20])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_host_copy_equals_the_plain_copy(nbytes, threads):
    """``host_copy`` cut into pieces on the copy workers gives the bytes ``copy_`` gives (the plain
    reference), for sizes that do not divide evenly and sizes below one piece; uint8 and fp32."""
    from fuyou.device.host_threads import host_copy

    g = torch.Generator().manual_seed(nbytes + threads)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    dst, ref = torch.zeros_like(src), torch.zeros_like(src)
    host_copy(dst, src, threads)
    ref.copy_(src)
    assert torch.equal(dst, ref)
    f_src = src[: nbytes // 4 * 4].view(torch.float32)
    f_dst = torch.zeros_like(f_src)
    host_copy(f_dst, f_src, threads)
    assert torch.equal(f_dst.view(torch.uint8), f_src.view(torch.uint8))


def test_host_copy_spreads_a_large_copy_over_the_workers():
    """A copy of 8 pieces is handed to the copy workers (serial threads named ``fuyou-copy``)."""
    from fuyou.device.host_threads import host_copy

    src = torch.ones(32 << 20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    host_copy(dst, src, 8)
    workers = [t for t in threading.enumerate() if t.name.startswith("fuyou-copy")]
    assert torch.equal(dst, src) and len(workers) >= 2, workers


def test_host_copy_refuses_mismatched_tensors():
    from fuyou.device.host_threads import host_copy

    with pytest.raises(ValueError, match="one dtype and size"):
        host_copy(torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        host_copy(torch.zeros(8, 8)[:, 0], torch.zeros(8))
