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
"""

from __future__ import annotations

import torch

__all__ = ["serial_worker"]


def serial_worker() -> None:
    """Run torch's host ops on the calling thread alone (its OpenMP parallel regions get no team).
    Call first thing in a data-moving worker thread (a ``ThreadPoolExecutor``'s ``initializer``);
    never in a thread that computes. Does nothing where ``threadpoolctl`` finds no OpenMP runtime."""
    torch.get_num_threads()  # torch sets this thread's OpenMP threads on first use: do it before the limit
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="openmp")
