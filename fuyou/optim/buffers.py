"""Validation of the flat buffers an AdamW step reads and writes, and their numpy views.

One step works on one layer's flat buffers (see ``state.py``): the fp32 master weights, m and v
(fp32, or bf16 for the small-state option), the gradient (fp32 or bf16) and optionally the bf16
copy of the new weights. All are 1-D, contiguous, on the CPU, of one length, and pairwise disjoint.
The split master (``split.py``) and 8-bit block-wise moments (``quant8.py``: int8/uint8 codes, one float32
scale per 256 elements, weight decay by runs) have their own checks here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fuyou.errors import FuyouError


class OptimBufferError(FuyouError, ValueError):
    """A buffer handed to the optimizer has the wrong dtype, length, device or layout."""


GRAD_DTYPES = (torch.float32, torch.bfloat16)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def _check_flat(
    name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], numel: int, why: str = "as the first buffer"
) -> None:
    """Raise OptimBufferError unless ``t`` is a 1-D contiguous CPU tensor of ``numel`` elements (``why``: the
    reason for that length, in the message)."""
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
        raise OptimBufferError(f"{name}: {t.numel()} elements, expected {numel} ({why})")
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


def check_int8_buffers(
    rem_or_master: torch.Tensor,
    m_q: torch.Tensor,
    v_q: torch.Tensor,
    m_scale: torch.Tensor,
    v_scale: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Validate one step's buffers with 8-bit block-wise moments (``fuyou.optim.quant8``): the split master's
    int16 remainders with its bf16 weights ``out``, or an fp32 master with ``out=None``; int8 ``m_q``, uint8
    ``v_q``; float32 scales, one per 256-element block; the gradient.

    Raises:
        OptimBufferError: if the first buffer is neither int16 nor float32; out is missing beside int16
            remainders, given beside an fp32 master, or not bf16; m_q is not int8, v_q not uint8, a scale
            buffer not float32 of ceil(n/256) elements; grad is not fp32/bf16; any buffer is not a flat
            contiguous CPU tensor of the first buffer's length; or two buffers overlap.
    """
    from fuyou.optim.quant8 import BLOCK, n_blocks  # quant8's reference imports this module

    first = rem_or_master
    if isinstance(first, torch.Tensor) and first.dtype == torch.int16:
        name = "rem"
        if not isinstance(out, torch.Tensor):
            raise OptimBufferError(
                f"out: the split master's remainders (int16) need its bf16 weights as out, got {type(out).__name__}"
            )
    elif isinstance(first, torch.Tensor) and first.dtype == torch.float32:
        name = "master"
        if out is not None:
            raise OptimBufferError("out: an fp32 master is its own weights; pass out=None")
    else:
        what = first.dtype if isinstance(first, torch.Tensor) else type(first).__name__
        raise OptimBufferError(f"rem_or_master: {what}, expected int16 remainders (split master) or a float32 master")
    n = first.numel()
    _check_flat(name, first, (first.dtype,), n)
    _check_flat("m_q", m_q, (torch.int8,), n)
    _check_flat("v_q", v_q, (torch.uint8,), n)
    why = f"one per {BLOCK}-element block of {n}"
    _check_flat("m_scale", m_scale, (torch.float32,), n_blocks(n), why)
    _check_flat("v_scale", v_scale, (torch.float32,), n_blocks(n), why)
    _check_flat("grad", grad, GRAD_DTYPES, n)
    named = {name: first, "m_q": m_q, "v_q": v_q, "m_scale": m_scale, "v_scale": v_scale, "grad": grad}
    if out is not None:
        _check_flat("out", out, (torch.bfloat16,), n)
        named["out"] = out
    _check_disjoint(named)


def check_runs(runs: Sequence[tuple[int, int, bool]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate weight-decay runs ``(a, z, decay)`` over an ``n``-element buffer: in order, each starting where
    the previous ended, from 0 to n (empty runs allowed; no runs only for n = 0). Returns ``(starts, decayed)``:
    int64 [R+1] run starts then n, uint8 [R] 1 where decayed.

    Raises:
        OptimBufferError: naming the first run that is malformed, leaves a gap or overlaps, or the end short of n.
    """
    if isinstance(runs, (str, bytes)) or not isinstance(runs, Sequence):
        raise OptimBufferError(f"runs: expected a sequence of (start, end, decay) triples, got {type(runs).__name__}")
    starts = np.empty(len(runs) + 1, dtype=np.int64)
    decayed = np.empty(len(runs), dtype=np.uint8)
    at = 0
    for i, run in enumerate(runs):
        malformed = OptimBufferError(f"runs[{i}]: {run!r}, expected (start: int, end: int, decay: bool)")
        if not (isinstance(run, (tuple, list)) and len(run) == 3):
            raise malformed
        a, z, d = run
        ints = all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in (a, z))
        if not (ints and isinstance(d, (bool, np.bool_))):
            raise malformed
        if a != at or z < a:
            raise OptimBufferError(
                f"runs[{i}]: ({a}, {z}) must start at {at} (where the previous run ended) and not end before it starts"
            )
        starts[i], decayed[i], at = a, d, z
    if at != n:
        raise OptimBufferError(f"runs: cover [0, {at}), expected [0, {n}) (every element in one run)")
    starts[-1] = n
    return starts, decayed


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view: fp32 as float32, bf16 and int16 as uint16 holding the same bits, int8/uint8 as such."""
    if t.dtype in (torch.bfloat16, torch.int16):
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()
