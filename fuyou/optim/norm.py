"""A gradient's squared L2 norm, the per-block term of the global gradient norm (clipping, and the
non-finite check that skips an update), and ``StepNorm``, which sums those terms where the gradients
are, so a step reads its norm (and its loss) back from the device once.

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
DEVICE_CHUNK = 1 << 24
"""Elements per fp32 partial sum on a device."""


def sum_squares_reference(grad: torch.Tensor) -> float:
    """Σ grad² in float64 (plain torch)."""
    return float(grad.double().square().sum())


def sum_squares(grad: torch.Tensor) -> float:
    """Σ grad² of a flat gradient as a Python float (a device→host sync for a device tensor)."""
    return float(sum_squares_lazy(grad))


def sum_squares_lazy(grad: torch.Tensor) -> float | torch.Tensor:
    """Σ grad² of a flat gradient, without waiting for the device: a float for a CPU tensor (float64
    accumulation, numba), a 0-d float64 tensor on the gradient's device otherwise (fp32 partial sums
    per ``DEVICE_CHUNK`` elements: the device's tree reductions keep fp32 accurate at that size).

    Non-finite gradients give a non-finite result (inf, or NaN).
    """
    if grad.device.type != "cpu" or grad.dtype not in (torch.float32, torch.bfloat16) or not grad.is_contiguous():
        parts = [torch.linalg.vector_norm(c, dtype=torch.float32) for c in grad.reshape(-1).split(DEVICE_CHUNK)]
        return torch.stack(parts).double().square().sum()
    from fuyou.optim.numba_kernel import sum_squares as kernel

    flat = as_numpy(grad.reshape(-1))
    with parallel_launch():
        return float(kernel(flat, CHUNK))


def read_scalars(*values: float | torch.Tensor) -> list[float]:
    """``values`` (floats, or 0-d tensors on one device) as floats, with one device→host copy for all
    the tensors: a step's one wait for the device (none on CPU)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.double() for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
