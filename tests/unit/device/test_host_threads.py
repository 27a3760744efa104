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
