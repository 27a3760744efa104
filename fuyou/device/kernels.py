"""GPU kernels beyond PyTorch's (sources in ``cuda/``), each with a plain torch reference.

``grad_pack(grad, out, scale)`` — one pass: ``out = grad * scale`` (same dtype) and the fp32 sum of
squares of ``out`` (the layer's contribution to the global gradient norm). On a CUDA tensor with
cupy installed it runs ``cuda/grad_pack.cu`` (compiled at run time by cupy's NVRTC); everywhere else
the reference runs. Device-agnostic: no ``torch.cuda`` here (the backend seam rule).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

SOURCES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "cuda")
BLOCK = 256


def grad_pack_reference(grad: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Reference: ``out[:] = (grad.float() * scale).to(out.dtype)``; returns the fp32 sum of squares (0-d)."""
    g = grad.float() * scale
    out.copy_(g.to(out.dtype))
    return (g * g).sum()


@functools.lru_cache(maxsize=1)
def _module() -> Any:
    import cupy  # optional: the cu12/cu13 extras

    with open(os.path.join(SOURCES, "grad_pack.cu")) as f:
        return cupy.RawModule(code=f.read(), options=("--std=c++17",), name_expressions=None)


def cupy_usable() -> bool:
    """True if cupy imports (it needs a CUDA driver to do anything)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def grad_pack(grad: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Fused scale/cast + squared norm; the CUDA kernel on GPU tensors (with cupy), else the reference.

    ``grad`` and ``out``: flat, contiguous, same dtype (bf16 or fp32), same device. Returns a 0-d fp32
    tensor on that device (no host sync).
    """
    if grad.device.type != "cuda" or not cupy_usable() or grad.dtype not in (torch.bfloat16, torch.float32):
        return grad_pack_reference(grad, out, scale)
    import cupy

    n = grad.numel()
    sumsq = torch.zeros((), dtype=torch.float32, device=grad.device)
    kernel = _module().get_function("grad_pack_bf16" if grad.dtype == torch.bfloat16 else "grad_pack_f32")
    blocks = max(1, min(4096, -(-n // (BLOCK * 4))))
    # Run on torch's current stream of the tensors' device, so it is ordered with the backward that
    # produced ``grad`` and the copy that reads ``out`` (the caller is inside ``backend.on(stream)``).
    stream = cupy.cuda.ExternalStream(_current_stream_ptr(grad.device))
    kernel(
        (blocks,),
        (BLOCK,),
        (grad.data_ptr(), out.data_ptr(), cupy.float32(scale), sumsq.data_ptr(), cupy.int64(n)),
        stream=stream,
    )
    return sumsq


def _current_stream_ptr(device: torch.device) -> int:
    """Raw handle of torch's current stream on ``device`` (through the backend seam)."""
    from fuyou.device.cuda import current_stream_ptr

    return current_stream_ptr(device)
