"""The split master: an fp32 master weight kept exactly as its bf16 compute weight plus a 16-bit remainder.

Training computes with ``w = bf16(M)`` (round to nearest even) of the fp32 master ``M``. Storing both
``M`` (4 B) and ``w`` (2 B) keeps the top half of ``M`` twice; the split format stores ``w`` and the
remainder ``r = bits(M) − bits(w)·2¹⁶`` only. Rounding to nearest puts ``r`` in [−2¹⁵, 2¹⁵], and the two
ends are ties (``M``'s low half exactly 0x8000), which round to the even neighbour: for an odd ``w`` neither
end occurs (65,535 values), for an even ``w`` both do (65,537). No 16-bit code alone can tell an even
``w``'s two ties apart (both read as the code −2¹⁵), so one more bit is needed there, and only there.
It lives in the sign bit of the element's second moment ``v``, which AdamW never makes negative: the
*tie flag*, set exactly when ``r = +2¹⁵``. Decoding is ``bits(M) = bits(w)·2¹⁶ + r`` in 32-bit
arithmetic, so exponent carries (``w`` rounded up into the next binade, or to infinity) come back
exactly, and so does the sign (rounding never crosses zero).

This module is the plain reference (torch integer ops, written to be read); the fused numba kernel
is ``numba_kernel.adamw_split_kernel``; ``tests/unit/optim/test_split.py`` holds the two to each other and
to the fp32-master update bit for bit.
"""

from __future__ import annotations

import torch

from fuyou.optim.args import AdamWHyper
from fuyou.optim.buffers import check_split_buffers
from fuyou.optim.reference import adamw_step_reference

_LOW = 0xFFFF
_TIE = 0x8000


def _u32(x: torch.Tensor) -> torch.Tensor:
    """fp32 bits as non-negative int64."""
    return x.view(torch.int32).long() & 0xFFFFFFFF


def _u16(x: torch.Tensor) -> torch.Tensor:
    """16-bit bits (bf16 or int16) as non-negative int64."""
    return x.view(torch.int16).long() & _LOW


def split_encode(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w, rem, flag)`` of fp32 ``master``: its bf16 compute weights (torch's round to nearest even),
    the remainders as int16 codes and the tie flags (bool: ``r = +2¹⁵``). Exact for every finite value
    and infinity; a NaN comes back a NaN."""
    w = master.to(torch.bfloat16)
    r = _u32(master) - (_u16(w) << 16)  # a NaN's decodes as some NaN: w's exponent is all ones
    code = ((r & _LOW) ^ _TIE) - _TIE  # the low 16 bits, sign-extended
    return w, code.to(torch.int16), r == _TIE


def split_decode(w: torch.Tensor, rem: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """The fp32 master of bf16 ``w``, int16 remainder codes ``rem`` and bool tie flags ``flag``."""
    r = rem.long() + flag.long() * (1 << 16)  # a flagged code is -2^15; its remainder +2^15
    bits = ((_u16(w) << 16) + r) & 0xFFFFFFFF
    return (bits - ((bits & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


def take_flag(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v without sign bits, the sign bits as bool)`` of a second moment (fp32 or bf16)."""
    ints = v.view(torch.int32 if v.dtype == torch.float32 else torch.int16)
    top = torch.iinfo(ints.dtype).min  # the sign bit alone
    return (ints & ~top).view(v.dtype), (ints & top) != 0


def put_flag(v: torch.Tensor, flag: torch.Tensor) -> None:
    """Set ``v``'s sign bits to ``flag`` in place (``v`` non-negative, fp32 or bf16)."""
    ints = v.view(torch.int32 if v.dtype == torch.float32 else torch.int16)
    top = torch.iinfo(ints.dtype).min
    ints.copy_(torch.where(flag, ints | top, ints & ~top))


def read_flags(rem: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The tie flags (bool) of a split master's remainders ``rem`` beside its second moments ``v``: v's sign
    bits (fp32 or bf16), or with 8-bit moments (``v`` uint8 codes, no sign bit) the parity of v's code where
    the remainder is the tie code (``fuyou.optim.quant8``)."""
    if v.dtype == torch.uint8:
        return (rem == -_TIE) & ((v & 1) != 0)
    return take_flag(v)[1]


def write_flags(rem: torch.Tensor, v: torch.Tensor, flag: torch.Tensor) -> None:
    """Store the tie flags ``flag`` of remainders ``rem`` in ``v`` in place, as ``read_flags`` reads them. With
    8-bit codes a tie's v code moves by one to the parity of its flag: meant for a new state, whose codes
    and scales are zero (every code then means 0)."""
    if v.dtype == torch.uint8:
        tie = rem == -_TIE
        v.copy_(torch.where(tie, (v & 0xFE) | flag.to(torch.uint8), v))
        return
    put_flag(v, flag)


def adamw_split_step_reference(
    rem: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    step: int,
    hyper: AdamWHyper = AdamWHyper(),
    grad_scale: float = 1.0,
    out: torch.Tensor,
) -> bool:
    """One AdamW step on a split master, in place: decode, the fp32-master reference step, encode.

    ``out`` holds the old bf16 compute weights and receives the new ones; ``rem`` (int16) the
    remainders; v's sign bits the tie flags. Other arguments as ``adamw_step_reference``. Returns whether
    every new master value is finite.

    Raises:
        OptimBufferError: if a buffer has the wrong dtype, length, device or layout, or two overlap.
        ConfigError: if lr, step or grad_scale is invalid.
    """
    check_split_buffers(rem, m, v, grad, out)
    v_abs, flag = take_flag(v)
    v.copy_(v_abs)
    master = split_decode(out, rem, flag)
    finite = adamw_step_reference(master, m, v, grad, lr=lr, step=step, hyper=hyper, grad_scale=grad_scale, out=None)
    w, code, tie = split_encode(master)
    out.copy_(w)
    rem.copy_(code)
    put_flag(v, tie)
    return finite
