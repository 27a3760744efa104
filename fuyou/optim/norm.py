"""A gradient's squared L2 norm, the per-block term of the global gradient norm (clipping, and the
non-finite check that skips an update).

On CPU tensors (the CPU backend's "device") torch's ``vector_norm`` of bf16 runs at ~0.85 G
elements/s on two cores — 0.3 s for a 262 M-parameter LM head, on the training thread — so
fp32/bf16 CPU tensors go through a numba kernel at memory speed with the GIL released
(``numba_kernel.sum_squares``, float64 accumulation). Device tensors use torch, which runs on the
device. ``sum_squares_reference`` is the plain oracle.

Threads: this kernel runs on the training thread while the Adam worker runs its own, so the launch
goes through ``parallel.parallel_launch`` (serialised under numba's ``workqueue`` layer, which
aborts on concurrent launches; free under ``omp``/``tbb``).
"""

from __future__ import annotations

import torch

from fuyou.optim.buffers import as_numpy
from fuyou.optim.parallel import parallel_launch

CHUNK = 1 << 16
"""Elements per parallel task."""


def sum_squares_reference(grad: torch.Tensor) -> float:
    """Σ grad² in float64 (plain torch)."""
    return float(grad.double().square().sum())


def sum_squares(grad: torch.Tensor) -> float:
    """Σ grad² of a flat gradient; float64 accumulation on CPU (numba), fp32 torch elsewhere.

    Non-finite gradients give a non-finite result (inf, or NaN).
    """
    if grad.device.type != "cpu" or grad.dtype not in (torch.float32, torch.bfloat16) or not grad.is_contiguous():
        return torch.linalg.vector_norm(grad, dtype=torch.float32).item() ** 2
    from fuyou.optim.numba_kernel import sum_squares as kernel

    flat = as_numpy(grad.reshape(-1))
    with parallel_launch():
        return float(kernel(flat, CHUNK))
