"""Worker threads that move data (SSD I/O, RAM-tier copies, gradient parking, the Adam stage's feeder)
run torch's host ops on themselves alone, leaving the cores' OpenMP team to compute.

Why: GNU OpenMP (libgomp, torch's intra-op pool on Linux) gives every thread that enters a parallel
region a team of its own. Once a process manages more OpenMP threads than there are cores, libgomp's
idle workers stop spinning and sleep almost at once (its "throttled" spin count), so each of compute's
thousands of small parallel regions per step waits for its workers to wake. Measured on a 2-core VM:
a SmolLM2 decoder layer's forward took 14.7 ms while an engine's 16 I/O threads had each made a team,
10.0 ms once they were gone; a LoRA step 1.8 s against its profile's 0.94 s prediction, timed in a
fresh process. ``omp_set_num_threads(1)`` in a worker thread (through ``threadpoolctl``, which finds
the libgomp torch loaded) is per thread by OpenMP's rules: the calling thread gets no team, and the
main thread and threads started later keep torch's setting (``torch.set_num_threads`` would change
the latter too).

The same holds for the CPU Adam's thread, which runs numba's parallel kernel: under numba's ``omp``
threading layer the kernel's team comes from the same libgomp as torch's (one ``libgomp.so.1`` per
process), and while that thread lives every small op of the training thread pays a worker's wake-up.
Measured on a 2-core VM (AMD EPYC, AVX2), 1000 element-wise products of 256 × 576 fp32 on the main
thread: 12–13 ms in a fresh process, 70–130 ms while an engine was open (also 2 s after its last step),
85 ms beside one idle thread whose numba kernel had run under ``omp``, 12–16 ms under ``tbb``; a
SmolLM2 layer's forward / backward in the engine 26 / 50 ms against 17.3 / 36.8 ms once the Adam thread
was a serial worker and numba ran on ``tbb`` (its quick-profile figure: 17.5 / 36.7). Hence the
``tbb`` dependency, which numba prefers when it loads, and ``serial_worker`` in the Adam thread too.

Host-to-host copies of whole extents (the RAM tier's reads and writes, Adam's new weights handed to
the loader) go through ``host_copy``: one serial thread copies ~4 GB/s on a server Xeon (measured on the
lent H100 machine: a 103 MB layer's weights in 25 ms, longer than the layer's forward), so the copy is
cut into ``COPY_THREADS`` pieces run at once on a small pool of serial workers (no OpenMP teams). The
planner's quick profile measures its host copy rate through the same function
(``fuyou.planner.measure.host_memcpy``).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["COPY_THREADS", "host_copy", "serial_worker"]

MAX_COPY_THREADS = 8
COPY_THREADS: int = max(1, min(MAX_COPY_THREADS, (os.cpu_count() or 1) // 2))
"""Threads one host copy is spread over: half the cores, at most 8 (memory bandwidth saturates
before that on the machines measured), one on a 2-core machine, whose other core computes."""
COPY_PIECE_BYTES = 4 << 20
"""Smallest piece a copy is cut into (bytes): below it a thread's start costs more than it saves."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def serial_worker() -> None:
    """Run torch's host ops on the calling thread alone (its OpenMP parallel regions get no team).
    Call first thing in a data-moving worker thread (a ``ThreadPoolExecutor``'s ``initializer``);
    never in a thread that computes. Does nothing where ``threadpoolctl`` finds no OpenMP runtime."""
    torch.get_num_threads()  # torch sets this thread's OpenMP threads on first use: do it before the limit
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="openmp")


def _copy_pool() -> ThreadPoolExecutor:
    """The process's copy workers (serial threads, started as pieces need them; the caller copies one)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_COPY_THREADS - 1, thread_name_prefix="fuyou-copy", initializer=serial_worker)
        return _pool


def host_copy(dst: torch.Tensor, src: torch.Tensor, threads: int = COPY_THREADS) -> None:
    """``dst.copy_(src)`` for contiguous host tensors of the same dtype and size, cut into at most
    ``threads`` (≤ ``MAX_COPY_THREADS``) pieces of ≥ ``COPY_PIECE_BYTES`` copied at once (the calling thread copies the last);
    returns when all are done. Raises ValueError for tensors of other sizes, dtypes, or not contiguous
    (the plain ``copy_`` is the reference: ``tests/unit/device/test_host_copy.py``)."""
    if dst.dtype != src.dtype or dst.numel() != src.numel() or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(
            f"host_copy needs contiguous tensors of one dtype and size, got {tuple(dst.shape)} {dst.dtype} "
            f"← {tuple(src.shape)} {src.dtype}"
        )
    n = dst.numel()
    pieces = max(1, min(threads, MAX_COPY_THREADS, n * dst.element_size() // COPY_PIECE_BYTES))
    if pieces == 1:
        dst.copy_(src)
        return
    d, s = dst.view(-1), src.view(-1)
    step = -(-n // pieces)
    starts = range(0, n, step)
    futs = [_copy_pool().submit(d[lo : lo + step].copy_, s[lo : lo + step]) for lo in starts[:-1]]
    d[starts[-1] :].copy_(s[starts[-1] :])
    for f in futs:
        f.result()
