"""Keep freed memory in the process while the CPU backend computes, as a GPU's caching allocator does.

On the CPU backend the "device" temporaries torch allocates inside a step (activations kept for
backward, autograd's weight gradients, logits, attention scores: megabytes to hundreds of MB each)
come from glibc's malloc, which gives large blocks back to the kernel on free (``munmap``, or
trimming the top of the heap) and so re-faults and re-zeroes them on every step. Measured on the
dev VM (156 M-parameter Llama, 4096 tokens/step, activations kept: 2 GB per step): ~0.5 M page
faults and 2–6 CPU-s of system time per step, steps 7–8.5 s; with the settings below ~100 faults,
0.35 s, steps 5.0 s. CUDA has no such cost (its caching allocator reuses device blocks), so without
this the CPU backend would measure the C library rather than the algorithm.

``keep_freed_memory`` sets glibc's ``M_MMAP_MAX`` to 0 (large blocks come from the heap, where freed
blocks are reused) and ``M_TRIM_THRESHOLD`` to 2 GiB − 1, the largest ``mallopt`` takes (an ``int``)
— what PyTorch's CPU performance guides reach with jemalloc/tcmalloc or ``GLIBC_TUNABLES``. The
cost: the process's resident size does not drop after a peak (beyond 2 GiB of free heap) until it
exits. Fuyou's explicit host memory (``host_aligned_empty``: I/O buffers, the RAM tier) is mmap'd
directly and unaffected. Set ``FUYOU_CPU_MALLOC=system`` to keep glibc's defaults. No effect
outside glibc (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1
"""Bytes of free memory at the top of the heap before glibc gives it back (``mallopt`` takes an int)."""

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings above once per process; returns whether they are in effect.

    Does nothing (False) outside glibc or with ``FUYOU_CPU_MALLOC=system``; never raises.
    """
    global _applied
    if _applied is None:
        _applied = False
        if os.environ.get("FUYOU_CPU_MALLOC", "").lower() != "system" and platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
                _applied = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
            except (OSError, AttributeError):
                _applied = False
    return _applied
