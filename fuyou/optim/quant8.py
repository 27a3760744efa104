"""8-bit block-wise AdamW moments beside an exact master: the scheme, its tables, and the plain reference.

Format ("int8" optimizer state). Per element: the master (the split master of ``fuyou.optim.split``: bf16
compute weight + int16 remainder, or beside fp32 compute weights the fp32 weight itself), the first moment
``m`` as an int8 code and the second moment ``v`` as a uint8 code. Per ``BLOCK`` = 256 consecutive elements
(blocks counted from element 0 of the buffers one step receives; the last block may be partial), one float32
scale per moment: ``m_scale[k]`` = max |m| and ``v_scale[k]`` = max v over block k (0 for an all-zero block).
Bytes per element beside the bf16 weights: 2 (remainder) + 1 (m) + 1 (v) + 8/256 (two scales) = 4.03125 B
instead of 2 + 4 + 4 = 10 B for fp32 moments (beside fp32 weights: 4 + 2.03125 = 6.03125 B).

Why this shape (Dettmers, Lewis, Shleifer, Zettlemoyer 2022, "8-bit Optimizers via Block-wise
Quantization", ICLR): Adam's moments span many orders of magnitude within one tensor, so a linear 8-bit
code loses the small values and one scale per tensor lets a single outlier flatten everything else. The paper
answers with (1) a non-linear "dynamic tree" code whose 256 values are spread over seven decades with more
resolution where the values are large, and (2) block-wise normalisation: each block is divided by its own
absolute maximum, so an outlier costs precision only within its block, and every block uses its code's full
range (the largest element of a block is stored exactly: code value 1.0). The paper's experiments use blocks
of 2048; bitsandbytes' block-wise optimizer state (``Optimizer8bit`` with ``block_wise=True``) allocates one
absmax per 256 elements, and torchao's ``AdamW8bit`` uses ``block_size=256`` too. 256 is what both production
libraries settled on: 1/64 B of scale per element and moment, outliers confined to 256 neighbours, and a
block is a natural unit of a CPU kernel (two 256-element float32 scratch rows stay in L1).

The maps. ``SIGNED_MAP`` (m) is bitsandbytes' signed dynamic map and ``UNSIGNED_MAP`` (v) its unsigned one
("dynamic" / "udynamic" of its optimizers), built here from their definition rather than from its code:
the magnitudes (0, 1] are cut into seven decades [10^(e-1), 10^e], e = -6 … 0, decade e is cut into
2^(e+6) equal bins (signed: 1, 2, …, 64; the sign takes the eighth bit) or 2^(e+7) bins (unsigned: 2, …, 128),
and every bin is represented by its centre ``10^e · (0.1 + 0.9 · (j + ½) / bins)``. With 0 and 1.0 added that
is 2·127 + 2 = 256 signed values (sorted: 127 negatives, 0 at index 127, 127 positives, 1.0 at index 255;
the most negative value is −0.99297, not −1, as in bitsandbytes) and 254 + 2 = 256 unsigned values in [1e-7, 1].

v's map has no zero, unlike bitsandbytes' (its lowest value is the lowest decade's edge, 1e-7): a second moment
below 2.1e-7 of its block's largest would round to 0, and its element, whose m need not be 0, would step by
``lr · m / eps``. On heavy-tailed sparse gradients (magnitudes spread over six decades, 30 % non-zero per step,
2^20 elements, 200 steps) 40 % of the elements ended with v at 0 under a non-zero m, single steps reached
1.9e5 × lr and the parameters' movement was 2000 × off fp32 AdamW's; with the floor, a v below it reads as the
floor — larger than it is, so its step is smaller, never larger (Li, Chen, Zhu 2023, "Memory Efficient
Optimizers with 4-bit States", name this the zero-point problem of v and drop zero from its map). A v that is
0 (an element no gradient reached) has m = 0: its step stays 0.
The values are computed exactly (``fractions.Fraction``), rounded to float64, and from float64 rounded once
to float32; the 255 midpoints are the float32 rounding of the float64 midpoint of each adjacent float64 pair.
Relative resolution: about 1/64 of a decade near the top of a block, coarser further down; the second moment
(always positive, its square root divides the step) gets the unsigned map's doubled resolution.

Storage: m's code is an int8 ``c`` meaning table index ``c + 128``; v's code is the uint8 table index. Any code
under a zero scale means 0 (a block no gradient reached), so all-zero bytes (``torch.zeros``) are a valid zero
state.

Quantizing ``x`` with block scale ``s``: ``xn = x / s`` in float32 (``xn = 0`` when ``s == 0``), index = the
number of midpoints strictly less than ``xn`` (``searchsorted(mid, xn, side='left')``: the nearest table
value, the float32 midpoints deciding; the kernel counts with a bucket table keyed by xn's bits, equal to the
search on every float32: ``numba_kernel.code_buckets``). Dequantizing: ``table[index] * s`` in float32.

One step, per element in float32, in ``numba_kernel._split_span``'s order: decode the master; ``m_old``,
``v_old`` dequantized; ``g = grad * grad_scale``; ``m = fma(1-b1, g - m_old, m_old)``;
``v = fma((1-b2)·g, g, v_old·b2)``; ``p = p·decay + (-(lr/bc1)·m) / (sqrt(v)/sqrt(bc2) + eps)``; encode ``p``.
The update uses the new m and v at full float32 precision; then each block's scales are its new absmaxes and
its new m and v are quantized with them. ``decay`` is ``1 - lr·weight_decay`` on the runs marked decayed and
exactly 1 elsewhere (``runs``: ``(a, z, decay)`` triples covering [0, n) in order; a block may straddle runs).

The split master's tie flag: with fp32/bf16 moments it lives in v's sign bit, but an unsigned 8-bit v has
none. Only elements whose remainder is the tie code (``-2^15``: ``r = ±2^15``) need it, and there the flag
(1 iff ``r = +2^15``) is the PARITY of v's code: quantize v to its nearest code ``c``; if the remainder is the
tie code and ``c & 1`` differs from the flag, take the neighbour on the value's side (``c+1`` if
``xn > table[c]`` else ``c-1``; at the ends 0 → 1, 255 → 254): at most one code step of v for about one
element in 2^15. Decoding: ``flag = (rem == -2^15) and (v_code & 1)``. The master stays exact: bit for bit
what the fp32-master AdamW computes from the same dequantized old moments.

This module is the plain reference (torch ops in float32, written to be read); the fused kernel is
``numba_kernel.adamw_int8_kernel`` (``adam_numba.adamw_int8_step``); ``tests/unit/optim/test_int8.py`` holds
the two to each other bit for bit, the master to ``adamw_step_reference``, and both to a float64 oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import torch

from fuyou.optim.args import AdamWHyper, step_coefficients
from fuyou.optim.buffers import check_int8_buffers, check_runs
from fuyou.optim.reference import _sqrt_exact
from fuyou.optim.split import split_decode, split_encode

BLOCK: int = 256
"""Elements per quantization block (one m scale and one v scale each)."""
TIE_CODE: int = -(1 << 15)
"""The split master's remainder code of a bf16 tie (``r = ±2^15``): only there does v's code parity count."""


def n_blocks(n: int) -> int:
    """Quantization blocks (scales per moment) of an ``n``-element buffer: ``ceil(n / BLOCK)``."""
    return -(-n // BLOCK)


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 sorted float64 values of the dynamic tree map in [-1, 1] (``signed``) or [1e-7, 1]: bin centres of
    seven decades cut into 2^(e+6) (signed) or 2^(e+7) equal bins for decade [10^(e-1), 10^e], plus 1 and, for
    m, 0; v's lowest value is the lowest decade's edge 1e-7 instead (no zero: see the module docstring)."""
    values = [Fraction(0) if signed else Fraction(1, 10**7), Fraction(1)]
    for e in range(-6, 1):
        bins = 2 ** (e + (6 if signed else 7))
        top = Fraction(10) ** e
        for j in range(bins):
            centre = top * (Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * j + 1, 2 * bins))
            values += [centre, -centre] if signed else [centre]
    table = np.array(sorted(float(x) for x in values), dtype=np.float64)  # float(): correctly rounded
    assert table.size == 256 and np.all(np.diff(table) > 0)
    return table


def _midpoints(table: np.ndarray) -> np.ndarray:
    return (table[:-1] + table[1:]) / 2.0


SIGNED_MAP_F64: np.ndarray = dynamic_map(signed=True)
"""The signed map (m) in float64, before its one rounding to float32 (the tests' oracle uses it)."""
UNSIGNED_MAP_F64: np.ndarray = dynamic_map(signed=False)
"""The unsigned map (v) in float64."""
SIGNED_MID_F64: np.ndarray = _midpoints(SIGNED_MAP_F64)
UNSIGNED_MID_F64: np.ndarray = _midpoints(UNSIGNED_MAP_F64)

SIGNED_MAP: np.ndarray = SIGNED_MAP_F64.astype(np.float32)
"""m's 256 values, sorted, float32; int8 code ``c`` means ``SIGNED_MAP[c + 128]``."""
SIGNED_MID: np.ndarray = SIGNED_MID_F64.astype(np.float32)
"""The 255 float32 midpoints of ``SIGNED_MAP`` (of its float64 values, rounded once)."""
UNSIGNED_MAP: np.ndarray = UNSIGNED_MAP_F64.astype(np.float32)
"""v's 256 values, sorted, float32; uint8 code ``c`` means ``UNSIGNED_MAP[c]``."""
UNSIGNED_MID: np.ndarray = UNSIGNED_MID_F64.astype(np.float32)
"""The 255 float32 midpoints of ``UNSIGNED_MAP``."""
for _t in (SIGNED_MAP_F64, UNSIGNED_MAP_F64, SIGNED_MID_F64, UNSIGNED_MID_F64):
    _t.setflags(write=False)
for _t in (SIGNED_MAP, SIGNED_MID, UNSIGNED_MAP, UNSIGNED_MID):
    _t.setflags(write=False)


def tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(SIGNED_MAP, SIGNED_MID, UNSIGNED_MAP, UNSIGNED_MID)`` as new float32 torch tensors."""
    return tuple(torch.tensor(t) for t in (SIGNED_MAP, SIGNED_MID, UNSIGNED_MAP, UNSIGNED_MID))  # type: ignore[return-value]


def _per_element(scales: torch.Tensor, n: int) -> torch.Tensor:
    """Each element's block scale."""
    return scales.repeat_interleave(BLOCK)[:n]


def quantize_block(
    x: torch.Tensor, *, signed: bool, ties: torch.Tensor | None = None, flags: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise 8-bit codes of float32 ``x`` [n]: ``(codes, scales)``, codes int8 (``signed``, for m) or
    uint8 (for v, ``x`` >= 0), scales float32 [n_blocks(n)] (max |x| per block).

    ``ties``/``flags`` (bool [n], unsigned only): where ``ties`` is set, the code's parity is made ``flags``
    by moving to the neighbour on the value's side (the split master's tie flag, see the module docstring).
    """
    n = x.numel()
    table, mid = tables()[:2] if signed else tables()[2:]
    padded = torch.zeros(n_blocks(n) * BLOCK, dtype=torch.float32)
    padded[:n] = x
    blocks = padded.view(-1, BLOCK)
    scales = (blocks.abs() if signed else blocks).amax(dim=1)
    s = _per_element(scales, n)
    xn = torch.where(s == 0, torch.zeros_like(x), x / s)
    index = torch.searchsorted(mid, xn, side="left")  # midpoints strictly below xn
    if ties is not None:
        assert flags is not None and not signed
        up = xn > table[index]
        other = torch.where(up, index + 1, index - 1)
        other = torch.where(other < 0, 1, other)  # 0 -> 1 (255 -> 254 falls out: xn > 1.0 never holds)
        index = torch.where(ties & ((index & 1) != flags.long()), other, index)
    codes = (index - 128).to(torch.int8) if signed else index.to(torch.uint8)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """float32 values of int8 (``signed``, m) or uint8 (v) codes [n] under block scales [n_blocks(n)]:
    ``table[index] * scale``."""
    table = tables()[0] if signed else tables()[2]
    index = codes.long() + 128 if signed else codes.long()
    return table[index] * _per_element(scales, codes.numel())


def int8_from_fp32(
    m: torch.Tensor, v: torch.Tensor, *, rem: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m_q, v_q, m_scale, v_scale)`` of existing moments ``m``, ``v`` [n] (fp32 or bf16), quantized as a step
    quantizes its new moments (for importing a state or starting one).

    ``rem``: the split master's int16 remainders; ``v``'s sign bits are then its tie flags (the fp32/bf16 split
    format, ``fuyou.optim.split``) and go into v's code parity. Without ``rem``, v's sign bits are ignored.
    An all-zero block gets zero scales and zero codes (v code 1 for a flagged tie): any code means 0 under a
    zero scale, and zero bytes are what ``torch.zeros`` buffers hold (a step itself writes m code -1, the
    table's 0, into such a block).
    """
    top = torch.iinfo(torch.int32).min  # the sign bit
    v_bits = v.float().view(torch.int32)
    v_abs = (v_bits & ~top).view(torch.float32)
    ties = flags = None
    if rem is not None:
        ties, flags = rem == TIE_CODE, (v_bits & top) != 0
    m_q, m_scale = quantize_block(m.float(), signed=True)
    v_q, v_scale = quantize_block(v_abs, signed=False, ties=ties, flags=flags)
    n = m_q.numel()
    m_q = torch.where(_per_element(m_scale, n) == 0, torch.zeros_like(m_q), m_q)
    return m_q, v_q, m_scale, v_scale


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of float32 tensors with one rounding (what the kernel's ``llvm.fma.f32`` gives).

    In float64 the product is exact (24 + 24 bits); the sum is rounded to odd (TwoSum finds whether it was
    exact; an inexact result with an even last bit moves one ulp towards the true value), and round-to-odd to
    53 bits followed by round-to-nearest to 24 bits is a correct rounding. Non-finite sums are left alone.
    """
    p = a.double() * b.double()
    c64 = c.double().expand_as(p)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # s + err == p + c exactly
    bits = s.view(torch.int64)
    fix = (err != 0) & ((bits & 1) == 0) & torch.isfinite(s)
    away = (err > 0) == (s > 0)  # the true value lies further from zero than s
    bits = torch.where(fix, bits + torch.where(away, 1, -1), bits)
    return bits.view(torch.float64).float()


def adamw_int8_step_reference(
    rem_or_master: torch.Tensor,
    m_q: torch.Tensor,
    v_q: torch.Tensor,
    m_scale: torch.Tensor,
    v_scale: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    step: int,
    hyper: AdamWHyper = AdamWHyper(),
    grad_scale: float = 1.0,
    out: torch.Tensor | None,
    runs: Sequence[tuple[int, int, bool]],
) -> bool:
    """One AdamW step with 8-bit block-wise moments, in place; returns whether every new master value is finite.

    Args:
        rem_or_master: int16 remainders of the split master [n] (then ``out`` is required), or the fp32 master
            itself [n] (then ``out=None``); updated in place.
        m_q, v_q: int8 / uint8 moment codes [n]; m_scale, v_scale: float32 block scales [n_blocks(n)].
        grad: fp32 or bf16 [n]; read only.
        out: the split master's bf16 weights [n]: the old ones on entry, the new ones on return; None beside an
            fp32 master.
        runs: ``(a, z, decay)`` triples covering [0, n) in order: weight decay applies where ``decay``.
        lr, step, hyper, grad_scale: as ``adamw_step``.

    Raises:
        OptimBufferError: if a buffer has the wrong dtype, length, device or layout, two overlap, or the runs
            do not cover the buffers.
        ConfigError: if lr, step or grad_scale is invalid.
    """
    check_int8_buffers(rem_or_master, m_q, v_q, m_scale, v_scale, grad, out)
    n = m_q.numel()
    check_runs(runs, n)
    k = step_coefficients(hyper, lr, step, grad_scale)

    def f32(x: np.float32) -> torch.Tensor:
        return torch.tensor(float(x), dtype=torch.float32)

    # decode
    if out is not None:
        flag = (rem_or_master == TIE_CODE) & ((v_q & 1) != 0)
        p = split_decode(out, rem_or_master, flag)
    else:
        p = rem_or_master.clone()
    m_old = dequantize(m_q, m_scale, signed=True)
    v_old = dequantize(v_q, v_scale, signed=False)
    decay = torch.ones(n, dtype=torch.float32)
    for a, z, decayed in runs:
        if decayed:
            decay[a:z] = f32(k.decay)
    # update, in the kernel's order
    g = grad.float() * f32(k.grad_scale)
    m = fma_f32(f32(k.m_weight), g - m_old, m_old)
    v = fma_f32(f32(k.v_weight) * g, g, v_old * f32(k.beta2))
    denom = _sqrt_exact(v) / f32(k.bc2_sqrt) + f32(k.eps)
    p = p * decay + (f32(k.neg_step_size) * m) / denom
    # encode
    ties = flags = None
    if out is not None:
        w, code, flags = split_encode(p)
        out.copy_(w)
        rem_or_master.copy_(code)
        ties = code == TIE_CODE
    else:
        rem_or_master.copy_(p)
    codes, scales = quantize_block(m, signed=True)
    m_q.copy_(codes)
    m_scale.copy_(scales)
    codes, scales = quantize_block(v, signed=False, ties=ties, flags=flags)
    v_q.copy_(codes)
    v_scale.copy_(scales)
    return bool(torch.isfinite(p).all())
