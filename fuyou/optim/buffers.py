"""Validation of the flat buffers an AdamW step reads and writes, and their numpy views.

One step works on one layer's flat buffers (see ``state.py``): the fp32 master weights, m and v
(fp32, or bf16 for the small-state option), the gradient (fp32 or bf16) and optionally the bf16
copy of the new weights. All are 1-D, contiguous, on the CPU, of one length, and pairwise disjoint.
"""

from __future__ import annotations

import numpy as np
import torch

from fuyou.errors import FuyouError


class OptimBufferError(FuyouError, ValueError):
    """A buffer handed to the optimizer has the wrong dtype, length, device or layout."""


GRAD_DTYPES = (torch.float32, torch.bfloat16)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def _check_flat(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], numel: int) -> None:
    """Raise OptimBufferError unless ``t`` is a 1-D contiguous CPU tensor of ``numel`` elements."""
    if not isinstance(t, torch.Tensor):
        raise OptimBufferError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise OptimBufferError(f"{name}: dtype {t.dtype}, expected {want}")
    if t.device.type != "cpu":
        raise OptimBufferError(f"{name}: on {t.device}, expected a CPU (host) tensor")
    if t.dim() != 1 or not t.is_contiguous():
        raise OptimBufferError(
            f"{name}: shape {tuple(t.shape)} stride {t.stride()}, expected a flat contiguous 1-D "
            "buffer (hint: pass t.view(-1) of a contiguous tensor)"
        )
    if t.numel() != numel:
        raise OptimBufferError(f"{name}: {t.numel()} elements, expected {numel} (as the first buffer)")
    if t.requires_grad:
        raise OptimBufferError(f"{name}: requires_grad=True; pass .detach() buffers")


def _check_disjoint(named: dict[str, torch.Tensor]) -> None:
    """Raise OptimBufferError if any two buffers share bytes (an in-place update would corrupt)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in named.items() if t.numel() > 0
    )
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise OptimBufferError(f"{name_a} and {name_b} overlap in memory; each needs its own buffer")


def check_buffers(
    master: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Validate one step's buffers.

    Raises:
        OptimBufferError: if master is not fp32; m and v are not both fp32 or both bf16; grad is
            not fp32/bf16; out is not bf16; any buffer is not a flat contiguous CPU tensor of
            master's length; or two buffers overlap.
    """
    _check_step("master", master, torch.float32, m, v, grad, out)


def _check_step(
    name: str, first: torch.Tensor, dtype: torch.dtype, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
    out: torch.Tensor | None,
) -> None:  # fmt: skip
    """The checks of ``check_buffers`` with the first buffer called ``name`` and of ``dtype``."""
    numel = first.numel() if isinstance(first, torch.Tensor) else -1
    _check_flat(name, first, (dtype,), numel)
    _check_flat("m", m, STATE_DTYPES, numel)
    _check_flat("v", v, STATE_DTYPES, numel)
    if m.dtype != v.dtype:
        raise OptimBufferError(f"m is {m.dtype} but v is {v.dtype}; they must share one dtype")
    _check_flat("grad", grad, GRAD_DTYPES, numel)
    named = {name: first, "m": m, "v": v, "grad": grad}
    if out is not None:
        _check_flat("out", out, (torch.bfloat16,), numel)
        named["out"] = out
    _check_disjoint(named)


def check_split_buffers(
    rem: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, out: torch.Tensor
) -> None:
    """Validate one split-master step's buffers (``fuyou.optim.split``): int16 remainders ``rem``, the
    bf16 weights ``out`` (read and written), m and v, the gradient.

    Raises:
        OptimBufferError: if rem is not int16; out is not bf16; m and v are not both fp32 or both bf16;
            grad is not fp32/bf16; any buffer is not a flat contiguous CPU tensor of rem's length; or two
            buffers overlap.
    """
    if not isinstance(out, torch.Tensor):
        raise OptimBufferError(f"out: expected the bf16 weights (a torch.Tensor), got {type(out).__name__}")
    _check_step("rem", rem, torch.int16, m, v, grad, out)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view: fp32 as float32, bf16 and int16 as uint16 holding the same bits."""
    if t.dtype in (torch.bfloat16, torch.int16):
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()
