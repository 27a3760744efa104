"""The fused AdamW kernel: one pass over a layer's flat buffers, parallel, GIL released.

Per element, in float32, in the order of ``torch.optim.AdamW``'s single-tensor path::

    g   = grad * grad_scale                     # bf16 grads are widened exactly first
    p   = p * (1 - lr*wd)                       # decoupled weight decay
    m   = fma(1-b1, g - m, m)                   # m.lerp_(g, 1-b1): ATen's vectorised lerp
    v   = fma((1-b2) * g, g, v * b2)            # v.mul_(b2).addcmul_(g, g, value=1-b2)
    p   = p + (-(lr/bc1) * m) / (sqrt(v) / sqrt(bc2) + eps)
    out = bf16(p)                               # optional, round-to-nearest-even

The two FMAs are where ATen's AVX2/AVX-512 kernels use one; everything else is a plain IEEE
float32 operation (no fastmath), so the vectorised and scalar code paths agree bit for bit and any
chunking of a buffer gives the whole-buffer result. The work is split into ``chunk``-element tasks
spread over numba's threads with ``prange``; LLVM vectorises each task's loop.

bf16: numba has no bfloat16, so bf16 arrays travel as ``uint16`` views of the same bytes. fp32→bf16
is round-to-nearest-even on the bit pattern, as PyTorch's CPU conversion for every finite value,
infinity and subnormal (no flush to zero). NaN: PyTorch's vectorised conversion (contiguous
tensors on x86 AVX2/AVX-512) writes ``0xFFFF`` for every NaN, its scalar path (strided tensors,
``ATEN_CPU_CAPABILITY=default``) ``0x7FC0``; we write ``0xFFFF``, what ``flat.to(torch.bfloat16)``
gives on the machines Fuyou runs on.

Threads: numba's ``workqueue`` threading layer aborts the process if two Python threads launch
parallel kernels at once, so every call takes ``KERNEL_LOCK``. In Fuyou only the Adam worker
thread calls the kernel (see ``worker.py``); the lock makes any other caller safe, not fast. The
number of numba threads is per calling thread (``numba.set_num_threads``).
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic, overload

from fuyou.errors import ConfigError
from fuyou.optim.args import AdamWHyper, step_coefficients
from fuyou.optim.buffers import as_numpy, check_buffers

# ---- bf16 bits and FMA, inlined into the kernel (kept in this file so that numba's cache,
# which only tracks the cached function's own source file, is invalidated when they change) ----
BF16_NAN_BITS: int = 0xFFFF
"""bf16 bit pattern written for any fp32 NaN (PyTorch's vectorised CPU conversion)."""


@intrinsic
def f32_from_bits(typingctx, bits):  # type: ignore[no-untyped-def]
    """Reinterpret the low 32 bits of an integer as float32 (a bit cast, no conversion)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        low = args[0]
        if bits.bitwidth > 32:
            low = builder.trunc(low, ir.IntType(32))
        elif bits.bitwidth < 32:
            low = builder.zext(low, ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def bits_from_f32(typingctx, x):  # type: ignore[no-untyped-def]
    """Reinterpret a float32 as uint32 (a bit cast, no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def fma_f32(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """Fused multiply-add ``a * b + c`` in float32 with a single rounding (llvm.fma.f32)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fma(args[0], args[1], args[2])

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def prefetch_w(typingctx, arr, idx):  # type: ignore[no-untyped-def]
    """Hint the CPU to fetch ``arr[idx]``'s cache line for writing (llvm.prefetch, no fault)."""
    if not (isinstance(arr, types.Array) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(
            context, builder, aryty, ary, [args[1]], wraparound=False, boundscheck=False
        )
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], fnty)
        # rw=1 (write), locality=3 (keep in all cache levels), cache type=1 (data)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(1), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


@njit(inline="always", cache=True)
def bf16_bits_to_f32(h: np.uint16) -> np.float32:
    """Widen bf16 bits to float32 (exact: bf16 is the top half of an fp32)."""
    return f32_from_bits(np.uint32(h) << np.uint32(16))


@njit(inline="always", cache=True)
def f32_to_bf16_bits(x: np.float32) -> np.uint16:
    """Round float32 to bf16 bits, nearest-even; any NaN becomes ``BF16_NAN_BITS``.

    Branch-free (the NaN case is an OR with an all-ones mask) so that it vectorises.
    """
    u = bits_from_f32(x)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan_mask = np.uint32((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)) * np.uint32(0xFFFF)
    return np.uint16((rounded | nan_mask) & np.uint32(0xFFFF))


def load_f32(arr, i):  # type: ignore[no-untyped-def]
    """``arr[i]`` as float32; ``arr`` is float32, or uint16 holding bf16 bits (numba only)."""
    raise NotImplementedError("load_f32 is only callable inside numba-compiled code")


def store_f32(arr, i, x):  # type: ignore[no-untyped-def]
    """Store float32 ``x`` in ``arr[i]``, rounded to bf16 bits if ``arr`` is uint16 (numba only)."""
    raise NotImplementedError("store_f32 is only callable inside numba-compiled code")


@overload(load_f32, inline="always")
def _load_f32_impl(arr, i):  # type: ignore[no-untyped-def]
    if arr.dtype == types.float32:
        return lambda arr, i: arr[i]
    if arr.dtype == types.uint16:
        return lambda arr, i: bf16_bits_to_f32(arr[i])
    return None


@overload(store_f32, inline="always")
def _store_f32_impl(arr, i, x):  # type: ignore[no-untyped-def]
    if arr.dtype == types.float32:

        def store_fp32(arr, i, x):  # type: ignore[no-untyped-def]
            arr[i] = x

        return store_fp32
    if arr.dtype == types.uint16:

        def store_bf16(arr, i, x):  # type: ignore[no-untyped-def]
            arr[i] = f32_to_bf16_bits(x)

        return store_bf16
    return None


# ---- the kernel ----
DEFAULT_CHUNK: int = 1 << 15
"""Elements per parallel task (32 Ki): large enough to amortise scheduling, small enough that the
two cores finish together; 8–128 Ki measured equal on the dev machine."""
BLOCK: int = 64
"""Elements updated between two rounds of software prefetch."""
PREFETCH_AHEAD: int = 512
"""How far ahead (elements) the prefetch runs. The update's long sqrt/div chains fill the
out-of-order window, so hardware prefetch alone leaves the kernel ~10 % short of the bandwidth
of the same loads and stores without arithmetic; this closes the gap (measured, dev machine)."""

KERNEL_LOCK = threading.Lock()
"""Serialises kernel launches across Python threads (numba parallel launches are not re-entrant)."""

_NO_OUT = np.empty(0, dtype=np.uint16)


@njit(nogil=True, error_model="numpy", inline="always", cache=True)
def _update_span(  # type: ignore[no-untyped-def]
    p, m, v, g, out, has_out, decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step
):
    """Update one span in place (0-based views, so LLVM vectorises without index-wrap checks)."""
    for i in range(p.size):
        gi = load_f32(g, i) * gscale
        mi = load_f32(m, i)
        mi = fma_f32(m_w, gi - mi, mi)
        vi = fma_f32(v_w * gi, gi, load_f32(v, i) * b2)
        denom = np.sqrt(vi) / bc2_sqrt + eps
        pi = p[i] * decay + (neg_step * mi) / denom
        p[i] = pi
        store_f32(m, i, mi)
        store_f32(v, i, vi)
        if has_out:
            out[i] = f32_to_bf16_bits(pi)


@njit(nogil=True, inline="always", cache=True)
def _prefetch_lines(arr, start, stop):  # type: ignore[no-untyped-def]
    """Prefetch every 64-byte line of ``arr[start:stop]`` (clipped to the array)."""
    stop = min(stop, arr.size)
    for i in range(start, stop, 64 // arr.itemsize):
        prefetch_w(arr, i)


@njit(nogil=True, error_model="numpy", inline="always", cache=True)
def _update_chunk(  # type: ignore[no-untyped-def]
    p, m, v, g, out, has_out, lo, hi, decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step
):
    """Update ``[lo, hi)`` block by block, prefetching ``PREFETCH_AHEAD`` elements ahead."""
    for b in range(lo, hi, BLOCK):
        e, f = min(b + BLOCK, hi), b + PREFETCH_AHEAD
        _prefetch_lines(p, f, f + BLOCK)
        _prefetch_lines(m, f, f + BLOCK)
        _prefetch_lines(v, f, f + BLOCK)
        _prefetch_lines(g, f, f + BLOCK)
        if has_out:
            _prefetch_lines(out, f, f + BLOCK)
        o = out[b:e] if has_out else out
        _update_span(
            p[b:e], m[b:e], v[b:e], g[b:e], o, has_out,
            decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step,
        )  # fmt: skip


@njit(parallel=True, nogil=True, error_model="numpy", cache=True)
def adamw_kernel(  # type: ignore[no-untyped-def]
    p, m, v, g, out, decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step, chunk
):
    """Fused AdamW over flat arrays, in place; ``out`` (uint16 bf16 bits) is written if non-empty.

    p: float32[n]; m, v: float32[n] or uint16[n] (bf16 bits); g: float32[n] or uint16[n];
    out: uint16[n] or uint16[0]; scalars: float32 coefficients (see ``args.StepCoefficients``);
    chunk: elements per parallel task (> 0).
    """
    n = p.size
    has_out = out.size != 0
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        _update_chunk(
            p, m, v, g, out, has_out, lo, min(lo + chunk, n),
            decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step,
        )  # fmt: skip


def adamw_step(
    master: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    step: int,
    hyper: AdamWHyper = AdamWHyper(),
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> None:
    """One AdamW step on flat CPU buffers with the numba kernel, in place.

    Args:
        master: fp32 master weights [n], updated in place.
        m, v: first/second moments [n], fp32 or (small-state option) bf16, updated in place.
        grad: gradient [n], fp32 or bf16; read only.
        lr: learning rate of this step (schedules may change it every call).
        step: 1-based step count of this update, for the bias corrections.
        hyper: betas, eps and decoupled weight decay.
        grad_scale: multiplies the gradient inside the kernel (global-norm clipping coefficient).
        out: optional bf16 [n] buffer that receives the new weights, rounded to nearest even.
        chunk: elements per parallel task; the result does not depend on it.

    Raises:
        OptimBufferError: if a buffer has the wrong dtype, length, device or layout, or two overlap.
        ConfigError: if lr, step, grad_scale or chunk is invalid.
    """
    check_buffers(master, m, v, grad, out)
    k = step_coefficients(hyper, lr, step, grad_scale)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"chunk={chunk!r} must be an int >= 1 (elements per parallel task)")
    if master.numel() == 0:
        return
    arrays = [as_numpy(t) for t in (master, m, v, grad)]
    out_np = _NO_OUT if out is None else as_numpy(out)
    with KERNEL_LOCK:
        adamw_kernel(
            *arrays, out_np,
            k.decay, k.grad_scale, k.m_weight, k.beta2, k.v_weight, k.bc2_sqrt, k.eps,
            k.neg_step_size, chunk,
        )  # fmt: skip
