"""The fused AdamW kernel (numba): one pass over a layer's flat buffers, parallel, GIL released.

Per element, in float32, in the order of ``torch.optim.AdamW``'s single-tensor path::

    g   = grad * grad_scale                     # bf16 grads are widened exactly first
    p   = p * (1 - lr*wd)                       # decoupled weight decay
    m   = fma(1-b1, g - m, m)                   # m.lerp_(g, 1-b1): ATen's vectorised lerp
    v   = fma((1-b2) * g, g, v * b2)            # v.mul_(b2).addcmul_(g, g, value=1-b2)
    p   = p + (-(lr/bc1) * m) / (sqrt(v) / sqrt(bc2) + eps)
    out = bf16(p)                               # optional, round-to-nearest-even

The two FMAs are where ATen's AVX2/AVX-512 kernels use one; everything else is a plain IEEE
float32 operation (no fastmath), so vectorised and scalar code agree bit for bit and any chunking
of a buffer gives the whole-buffer result.

bf16: numba has no bfloat16, so bf16 arrays travel as ``uint16`` views of the same bytes.
fp32→bf16 is round-to-nearest-even on the bit pattern, as PyTorch's CPU conversion, for every
finite value, infinity and subnormal (no flush to zero). NaN: PyTorch's vectorised conversion
(contiguous tensors on x86 AVX2/AVX-512) writes ``0xFFFF`` for every NaN, its scalar path (strided
tensors, ``ATEN_CPU_CAPABILITY=default``) ``0x7FC0``; we write ``0xFFFF``, what
``flat.to(torch.bfloat16)`` gives on the machines Fuyou runs on.

Memory: the update is bandwidth-bound (28 B/param in the Fuyou configuration). Work is split into
``chunk``-element tasks over numba's threads (``prange``), each task into ``BLOCK``-element blocks.
Before a block, the lines ``PREFETCH_AHEAD`` elements ahead are prefetched (the sqrt/div chains fill
the out-of-order window, so hardware prefetch alone falls ~10 % short). The bf16 copy is computed
into a small scratch buffer and written with 64-byte non-temporal stores when the destination is
aligned, which saves the read-for-ownership of a write-only stream (2 of 30 DRAM bytes/param).

All jitted code lives in this one file on purpose: numba's on-disk cache (``cache=True``) only
checks the source file of the cached function, so a helper changed in another file would leave a
stale compiled kernel behind.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic, overload

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

BF16_NAN_BITS: int = 0xFFFF
"""bf16 bit pattern written for any fp32 NaN (PyTorch's vectorised CPU conversion)."""


@intrinsic
def f32_from_bits(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as float32 (a bit cast, no conversion)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = args[0]
        if bits.bitwidth > 32:
            low = builder.trunc(low, ir.IntType(32))
        elif bits.bitwidth < 32:
            low = builder.zext(low, ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def bits_from_f32(typingctx, x):
    """Reinterpret a float32 as uint32 (a bit cast, no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def fma_f32(typingctx, a, b, c):
    """Fused multiply-add ``a * b + c`` in float32 with a single rounding (llvm.fma.f32)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(args[0], args[1], args[2])

    return types.float32(types.float32, types.float32, types.float32), codegen


def _item_ptr(context, builder, aryty, ary_val, idx):
    """LLVM pointer to ``ary[idx]`` (no wraparound, no bounds check)."""
    ary = context.make_array(aryty)(context, builder, ary_val)
    return cgutils.get_item_pointer(context, builder, aryty, ary, [idx], False, False)


@intrinsic
def prefetch_w(typingctx, arr, idx):
    """Hint the CPU to fetch ``arr[idx]``'s cache line for writing (llvm.prefetch; never faults)."""
    if not (isinstance(arr, types.Array) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        ptr = builder.bitcast(_item_ptr(context, builder, signature.args[0], *args), i8p)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], fnty)
        builder.call(fn, [ptr, i32(1), i32(3), i32(1)])  # write, keep in all levels, data
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


@intrinsic
def nt_store_line(typingctx, dst, di, src, si):
    """Copy 64 bytes ``src[si:]`` → ``dst[di:]`` with a non-temporal store.

    The caller guarantees 64-byte alignment of ``&dst[di]`` and 64 readable bytes at ``&src[si]``.
    """
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array)):
        return None
    if not dst.dtype == src.dtype == types.uint16:
        return None

    def codegen(context, builder, signature, args):
        vty = ir.VectorType(ir.IntType(16), 32).as_pointer()
        d = builder.bitcast(_item_ptr(context, builder, signature.args[0], args[0], args[1]), vty)
        s = builder.bitcast(_item_ptr(context, builder, signature.args[2], args[2], args[3]), vty)
        st = builder.store(builder.load(s, align=2), d, align=64)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
        return context.get_dummy_value()

    return types.void(dst, di, src, si), codegen


@intrinsic
def store_fence(typingctx):
    """Order this thread's non-temporal stores before its later stores (x86: sfence).

    LLVM lowers a seq_cst fence to a locked instruction on x86, which is not documented to order
    weakly ordered (non-temporal) stores, so x86 gets an explicit ``sfence``.
    """

    def codegen(context, builder, signature, args):
        if _X86:
            fn = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(fn, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


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


def load_f32(arr, i):
    """``arr[i]`` as float32; ``arr`` is float32, or uint16 holding bf16 bits (numba only)."""
    raise NotImplementedError("load_f32 is only callable inside numba-compiled code")


def store_f32(arr, i, x):
    """Store float32 ``x`` in ``arr[i]``, rounded to bf16 bits if ``arr`` is uint16 (numba only)."""
    raise NotImplementedError("store_f32 is only callable inside numba-compiled code")


@overload(load_f32, inline="always")
def _load_f32_impl(arr, i):
    if arr.dtype == types.float32:
        return lambda arr, i: arr[i]
    if arr.dtype == types.uint16:
        return lambda arr, i: bf16_bits_to_f32(arr[i])
    return None


@overload(store_f32, inline="always")
def _store_f32_impl(arr, i, x):
    if arr.dtype == types.float32:

        def store_fp32(arr, i, x):
            arr[i] = x

        return store_fp32
    if arr.dtype == types.uint16:

        def store_bf16(arr, i, x):
            arr[i] = f32_to_bf16_bits(x)

        return store_bf16
    return None


# ---- the kernel ----


DEFAULT_CHUNK: int = 1 << 15
"""Elements per parallel task (32 Ki); 8–128 Ki measured equal on the dev machine."""
BLOCK: int = 128
"""Elements per block: prefetch, update, bf16 copy out. 64–128 measured best, 256 is slower."""
PREFETCH_AHEAD: int = 1024
"""Prefetch distance in elements (4 KiB ahead in fp32); 512–1024 best, 2048 slower."""


@njit(nogil=True, error_model="numpy", inline="always", cache=True)
def _update_span(p, m, v, g, out, has_out, decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step):
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
def _nonfinite_bits(p):
    """Bit 31 set iff some value of the float32 span ``p`` is NaN or ±inf: an all-ones exponent
    (0x7f800000) plus 0x00800000 carries into bit 31, any other exponent does not (integer ops only,
    so the OR reduction vectorises; run on a block just written, still in L1)."""
    acc = np.uint32(0)
    for i in range(p.size):
        acc |= (bits_from_f32(p[i]) & np.uint32(0x7F800000)) + np.uint32(0x00800000)
    return acc & np.uint32(0x80000000)


@njit(nogil=True, inline="always", cache=True)
def _prefetch_block(arr, start):
    """Prefetch every 64-byte line of ``arr[start:start+BLOCK]`` (clipped to the array)."""
    for i in range(start, min(start + BLOCK, arr.size), 64 // arr.itemsize):
        prefetch_w(arr, i)


@njit(nogil=True, inline="always", cache=True)
def _write_out(out, lo, hi, scratch):
    """``out[lo:hi] = scratch[:hi-lo]``: non-temporal for a full, 64-byte-aligned block."""
    if hi - lo == BLOCK and (out.ctypes.data + 2 * lo) % 64 == 0:
        for j in range(0, BLOCK, 32):
            nt_store_line(out, lo + j, scratch, j)
    else:
        for j in range(hi - lo):
            out[lo + j] = scratch[j]


@njit(nogil=True, error_model="numpy", inline="always", cache=True)
def _update_chunk(p, m, v, g, out, has_out, lo, hi, decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step):
    """Update ``[lo, hi)`` block by block, prefetching ahead and writing the copy out; True if a new
    master value is non-finite."""
    bad = False
    scratch = np.empty(BLOCK if has_out else 0, dtype=np.uint16)
    for b in range(lo, hi, BLOCK):
        e, f = min(b + BLOCK, hi), b + PREFETCH_AHEAD
        _prefetch_block(p, f)
        _prefetch_block(m, f)
        _prefetch_block(v, f)
        _prefetch_block(g, f)
        _update_span(
            p[b:e], m[b:e], v[b:e], g[b:e], scratch[: e - b], has_out,
            decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step,
        )  # fmt: skip
        bad |= _nonfinite_bits(p[b:e]) != 0
        if has_out:
            _write_out(out, b, e, scratch)
    if has_out:
        store_fence()
    return bad


@njit(parallel=True, nogil=True, error_model="numpy", cache=True)
def adamw_kernel(p, m, v, g, out, decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step, chunk):
    """Fused AdamW over flat arrays, in place; ``out`` (uint16 bf16 bits) is written if non-empty.
    Returns True if every new master value is finite (the check rides on the update: no extra pass).

    p: float32[n]; m, v: float32[n] or uint16[n] (bf16 bits); g: float32[n] or uint16[n];
    out: uint16[n] or uint16[0]; scalars: float32 coefficients (see ``args.StepCoefficients``);
    chunk: elements per parallel task (> 0).
    """
    n = p.size
    has_out = out.size != 0
    tasks = (n + chunk - 1) // chunk
    bad = np.zeros(tasks, dtype=np.uint8)
    for c in prange(tasks):
        lo = c * chunk
        bad[c] = _update_chunk(
            p, m, v, g, out, has_out, lo, min(lo + chunk, n),
            decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step,
        )  # fmt: skip
    return not bad.any()


# ---- the split master: bf16 compute weight + 16-bit remainder (``fuyou.optim.split``) ----


def load_flagged(arr, i):
    """``(arr[i] without its sign bit as float32, the sign bit as uint32 0/1)``: a second moment, which is
    never negative, carrying the split master's tie flag in its sign bit (numba only)."""
    raise NotImplementedError("load_flagged is only callable inside numba-compiled code")


def store_flagged(arr, i, x, flag):
    """Store the non-negative float32 ``x`` in ``arr[i]`` (bf16-rounded if ``arr`` is uint16) with the
    uint32 ``flag`` (0/1) in its sign bit (numba only)."""
    raise NotImplementedError("store_flagged is only callable inside numba-compiled code")


@overload(load_flagged, inline="always")
def _load_flagged_impl(arr, i):
    if arr.dtype == types.float32:

        def load_fp32(arr, i):
            u = bits_from_f32(arr[i])
            return f32_from_bits(u & np.uint32(0x7FFFFFFF)), u >> np.uint32(31)

        return load_fp32
    if arr.dtype == types.uint16:

        def load_bf16(arr, i):
            u = np.uint32(arr[i])
            return bf16_bits_to_f32(np.uint16(u & np.uint32(0x7FFF))), u >> np.uint32(15)

        return load_bf16
    return None


@overload(store_flagged, inline="always")
def _store_flagged_impl(arr, i, x, flag):
    if arr.dtype == types.float32:

        def store_fp32(arr, i, x, flag):
            arr[i] = f32_from_bits(bits_from_f32(x) | (flag << np.uint32(31)))

        return store_fp32
    if arr.dtype == types.uint16:

        def store_bf16(arr, i, x, flag):
            arr[i] = np.uint16(np.uint32(f32_to_bf16_bits(x)) | (flag << np.uint32(15)))

        return store_bf16
    return None


@njit(inline="always", cache=True)
def split_join(w: np.uint16, code: np.uint16, flag: np.uint32) -> np.float32:
    """The fp32 master of bf16 weight bits ``w``, remainder ``code`` (int16 bits) and tie ``flag``:
    bits(w) · 2¹⁶ + r, r the sign-extended code, or +2¹⁵ where the flag is set (code −2¹⁵)."""
    c = np.uint32(code)
    r = c - ((c & np.uint32(0x8000)) << np.uint32(1)) + (flag << np.uint32(16))  # mod 2³²
    return f32_from_bits((np.uint32(w) << np.uint32(16)) + r)


@njit(nogil=True, error_model="numpy", inline="always", cache=True)
def _split_span(rem, m, v, g, w, decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step):
    """``_update_span`` on a split master: decode from ``w`` (bf16 bits, in/out), ``rem`` and v's sign
    bit, update, encode back; returns bit 31 set iff a new master value is non-finite."""
    acc = np.uint32(0)
    for i in range(rem.size):
        vi, flag = load_flagged(v, i)
        p = split_join(w[i], rem[i], flag)
        gi = load_f32(g, i) * gscale
        mi = load_f32(m, i)
        mi = fma_f32(m_w, gi - mi, mi)
        vi = fma_f32(v_w * gi, gi, vi * b2)
        denom = np.sqrt(vi) / bc2_sqrt + eps
        p = p * decay + (neg_step * mi) / denom
        u = bits_from_f32(p)
        wn = f32_to_bf16_bits(p)
        r = u - (np.uint32(wn) << np.uint32(16))  # in [-2^15, 2^15] mod 2^32 for a finite p
        w[i] = wn
        rem[i] = np.uint16(r & np.uint32(0xFFFF))
        store_f32(m, i, mi)
        store_flagged(v, i, vi, np.uint32(r == np.uint32(0x8000)))
        acc |= (u & np.uint32(0x7F800000)) + np.uint32(0x00800000)
    return acc & np.uint32(0x80000000)


@njit(parallel=True, nogil=True, error_model="numpy", cache=True)
def adamw_split_kernel(rem, m, v, g, w, decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step, chunk):
    """Fused AdamW on a split master, in place: ``w`` (uint16 bf16 bits) holds the old compute weights
    and receives the new ones, ``rem`` (uint16: int16 bits) the remainders, v's sign bits the tie flags
    (``fuyou.optim.split``). Returns True if every new master value is finite.

    rem, w: uint16[n]; m, v: float32[n] or uint16[n] (bf16 bits); g: float32[n] or uint16[n];
    scalars as ``adamw_kernel``; chunk: elements per parallel task (> 0).
    """
    n = rem.size
    tasks = (n + chunk - 1) // chunk
    bad = np.zeros(tasks, dtype=np.uint8)
    for c in prange(tasks):
        lo, hi = c * chunk, min(c * chunk + chunk, n)
        acc = np.uint32(0)
        for b in range(lo, hi, BLOCK):
            e = min(b + BLOCK, hi)
            acc |= _split_span(
                rem[b:e], m[b:e], v[b:e], g[b:e], w[b:e],
                decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step,
            )  # fmt: skip
        bad[c] = acc != 0
    return not bad.any()


# ---- 8-bit block-wise moments beside the split or fp32 master (``fuyou.optim.quant8``) ----


INT8_BLOCK: int = 256
"""Elements per quantization block: ``quant8.BLOCK`` (a test holds the two equal)."""
INT8_CHUNK: int = 1 << 15
"""Elements per parallel task of ``adamw_int8_kernel`` (128 blocks); a multiple of ``INT8_BLOCK``."""

# Quantizing needs the number of a map's 255 sorted midpoints strictly below xn (``searchsorted(mid, xn)``).
# A binary search is 8 dependent loads; instead a bucket table, keyed by xn's float32 bits, holds the count
# of midpoints below the bucket's smallest value, and one comparison with the next midpoint finishes: exact
# whenever no bucket holds two midpoints (``code_buckets`` checks it). Key: the sign; the exponent, clamped
# to [2^-23, 2) (every |xn| < 2^-23 lies between the midpoints nearest 0 of both maps, so the sub-2^-23 range
# is one bucket per sign; |xn| >= 1 only at 1.0, or NaN); the top ``INT8_SUB_BITS`` mantissa bits.
INT8_E0: int = 104
"""Biased exponent of 2^-23: |xn| below it shares bucket key 0."""
INT8_KEYS: int = 25
"""Exponent keys: 0 (|xn| < 2^-23), then the binades of 2^-23 … 2^0 (1..24; larger exponents clamp to 24)."""
INT8_SUB_BITS: int = 7
"""Mantissa bits per key: 128 buckets per binade, finer than the densest midpoints of either map."""


def code_buckets(mid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(buckets, mid_padded)`` for ``_code_lookup`` from a map's 255 sorted float32 midpoints: uint8
    [2·INT8_KEYS·2^INT8_SUB_BITS] counts of midpoints below each bucket (sign-major), and the midpoints with +inf
    appended. Plain numpy (not jitted). Raises AssertionError if a bucket holds two midpoints."""
    sub = 1 << INT8_SUB_BITS
    k = np.arange(INT8_KEYS, dtype=np.int64)[:, None]
    t = np.arange(sub, dtype=np.int64)[None, :]
    low = np.where(k == 0, 0, ((INT8_E0 + k - 1) << 23) | (t << (23 - INT8_SUB_BITS)))
    high = np.where(k == 0, (INT8_E0 << 23) - 1, low | ((1 << (23 - INT8_SUB_BITS)) - 1))
    low_f, high_f = (x.astype(np.uint32).view(np.float32).ravel() for x in (low, high))
    first = np.concatenate([low_f, -high_f])  # each bucket's smallest value: positive buckets, then negative
    last = np.concatenate([high_f, -low_f])
    below = np.searchsorted(mid, first, side="left")
    inside = np.searchsorted(mid, last, side="left") - below  # midpoints in [first, last)
    assert mid.size == 255 and inside.max() <= 1, "a bucket holds two midpoints"
    return below.astype(np.uint8), np.append(mid, np.float32(np.inf)).astype(np.float32)


@njit(inline="always", cache=True)
def _code_lookup(buckets, mid, x):
    """The number of midpoints strictly below float32 ``x`` (0..255; NaN gives 0 or 255) from ``code_buckets``'
    tables: equal to ``searchsorted(mid[:255], x, side='left')``."""
    u = bits_from_f32(x)
    e = np.int64((u >> np.uint32(23)) & np.uint32(0xFF)) - np.int64(INT8_E0 - 1)
    k = min(max(e, np.int64(0)), np.int64(INT8_KEYS - 1))
    t = np.int64((u >> np.uint32(23 - INT8_SUB_BITS)) & np.uint32((1 << INT8_SUB_BITS) - 1)) * np.int64(k > 0)
    below = np.int64(buckets[((np.int64(u >> np.uint32(31)) * INT8_KEYS + k) << INT8_SUB_BITS) + t])
    return below + np.int64(mid[below] < x)


@njit(nogil=True, cache=True)
def code_indices(buckets, mid, x):
    """``_code_lookup`` over a float32 array (for the tests): int64 counts of midpoints below each value."""
    out = np.empty(x.size, dtype=np.int64)
    for i in range(x.size):
        out[i] = _code_lookup(buckets, mid, x[i])
    return out


def int8_master_load(first, w, i, vcode):
    """Element ``i``'s float32 master: the split master of remainder ``first[i]`` (uint16), weight ``w[i]`` and
    the tie flag in the parity of v's code ``vcode``, or ``first[i]`` itself (float32) (numba only)."""
    raise NotImplementedError("int8_master_load is only callable inside numba-compiled code")


def int8_master_store(first, w, i, p):
    """Store the float32 master ``p`` of element ``i`` (split into ``w``/``first`` or in ``first``); returns the
    uint8 tie bits: 2 | flag where the new remainder is the tie code, else 0 (numba only)."""
    raise NotImplementedError("int8_master_store is only callable inside numba-compiled code")


@overload(int8_master_load, inline="always")
def _int8_master_load_impl(first, w, i, vcode):
    if first.dtype == types.uint16:

        def load_split(first, w, i, vcode):
            c = first[i]
            flag = np.uint32(c == np.uint16(0x8000)) & (np.uint32(vcode) & np.uint32(1))
            return split_join(w[i], c, flag)

        return load_split
    if first.dtype == types.float32:
        return lambda first, w, i, vcode: first[i]
    return None


@overload(int8_master_store, inline="always")
def _int8_master_store_impl(first, w, i, p):
    if first.dtype == types.uint16:

        def store_split(first, w, i, p):
            u = bits_from_f32(p)
            wn = f32_to_bf16_bits(p)
            r = u - (np.uint32(wn) << np.uint32(16))  # in [-2^15, 2^15] mod 2^32 for a finite p
            low = r & np.uint32(0xFFFF)
            w[i] = wn
            first[i] = np.uint16(low)
            return np.uint8((np.uint32(low == np.uint32(0x8000)) << np.uint32(1)) | np.uint32(r == np.uint32(0x8000)))

        return store_split
    if first.dtype == types.float32:

        def store_fp32(first, w, i, p):
            first[i] = p
            return np.uint8(0)

        return store_fp32
    return None


@njit(nogil=True, inline="always", cache=True)
def _int8_dequantize(m_q, v_q, ms, vs, smap, umap, m, v):
    """Old moments of one block into the scratch rows: ``m = smap[m_q + 128] * ms``, ``v = umap[v_q] * vs``
    (table lookups: kept apart so that the update loop has none and vectorises)."""
    for j in range(m_q.size):
        m[j] = smap[np.int64(m_q[j]) + 128] * ms
        v[j] = umap[np.int64(v_q[j])] * vs


@njit(nogil=True, error_model="numpy", inline="always", cache=True)
def _int8_update(first, w, v_q, g, fac, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step, m, v, tie):
    """Pass 1 over one run's part of a block (0-based views): decode the master (the tie flag from v's code
    parity), update as ``_split_span`` with decay factor ``fac`` from the old moments in ``m``, ``v`` (replaced
    by the new ones), encode; ``tie`` receives the tie bits. Returns bit 31 set iff a new master value is
    non-finite."""
    acc = np.uint32(0)
    for j in range(m.size):
        p = int8_master_load(first, w, j, v_q[j])
        gi = load_f32(g, j) * gscale
        mo = m[j]
        mi = fma_f32(m_w, gi - mo, mo)
        vi = fma_f32(v_w * gi, gi, v[j] * b2)
        denom = np.sqrt(vi) / bc2_sqrt + eps
        p = p * fac + (neg_step * mi) / denom
        tie[j] = int8_master_store(first, w, j, p)
        m[j] = mi
        v[j] = vi
        acc |= (bits_from_f32(p) & np.uint32(0x7F800000)) + np.uint32(0x00800000)
    return acc & np.uint32(0x80000000)


@njit(nogil=True, inline="always", cache=True)
def _abs_max(x):
    """max |x| of a float32 span (+0.0 if empty or all zero) as the maximum of the magnitudes' bit patterns:
    the same value as the float maximum (a NaN wins: its bits exceed infinity's), and it vectorises."""
    acc = np.uint32(0)
    for j in range(x.size):
        acc = max(acc, bits_from_f32(x[j]) & np.uint32(0x7FFFFFFF))
    return f32_from_bits(acc)


@njit(nogil=True, error_model="numpy", inline="always", cache=True)
def _int8_quantize(m_q, v_q, m, v, tie, ms, vs, sbuck, smid, ubuck, umid, umap):
    """Pass 2 over one block (0-based views): codes of the new moments ``m``, ``v`` (overwritten by xn) under the
    block's new scales ``ms``, ``vs``; a tie's v code takes the parity of its flag (the neighbour on xn's side)."""
    m_den = ms if ms != np.float32(0.0) else np.float32(1.0)  # a zero scale: every value is ±0, so xn = ±0
    v_den = vs if vs != np.float32(0.0) else np.float32(1.0)
    for j in range(m.size):
        m[j] = m[j] / m_den
        v[j] = v[j] / v_den
    for j in range(m.size):
        m_q[j] = np.int8(_code_lookup(sbuck, smid, m[j]) - 128)
        xv = v[j]
        c = _code_lookup(ubuck, umid, xv)
        t = np.int64(tie[j])
        if (t & 2) != 0 and (c & 1) != (t & 1):
            c = c + 1 if xv > umap[c] else c - 1
            if c < 0:
                c = 1
        v_q[j] = np.uint8(c)


@njit(parallel=True, nogil=True, error_model="numpy", cache=True)
def adamw_int8_kernel(
    first, m_q, v_q, m_scale, v_scale, g, w, starts, decayed, smap, umap, sbuck, smid, ubuck, umid,
    decay, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step, chunk,
):  # fmt: skip
    """Fused dequantize → AdamW → quantize with 8-bit block-wise moments (``fuyou.optim.quant8``), in place.
    Returns True if every new master value is finite.

    first: uint16[n] (int16 bits: the split master's remainders; ``w`` uint16[n] its bf16 weights, old in, new
    out) or float32[n] (the fp32 master; ``w`` uint16[0]); m_q: int8[n]; v_q: uint8[n]; m_scale, v_scale:
    float32[ceil(n/256)]; g: float32[n] or uint16[n] (bf16 bits); starts: int64[R+1] run starts then n;
    decayed: uint8[R]: the factor ``decay`` on run r if ``decayed[r]``, else exactly 1; smap, umap: the maps
    (float32[256]); sbuck, smid, ubuck, umid: ``code_buckets`` of their midpoints (tables are arguments, not
    globals, so that a stale cache cannot keep old ones); scalars as ``adamw_kernel``; chunk: elements per
    parallel task, a positive multiple of ``INT8_BLOCK`` (no block straddles two tasks).

    Per block: the old moments are dequantized into two 256-element float32 scratch rows, pass 1 updates every
    element (run by run) and leaves the new m and v there, the block's new absmaxes become its scales, and
    pass 2 writes the codes.
    """
    n = m_q.size
    tasks = (n + chunk - 1) // chunk
    bad = np.zeros(tasks, dtype=np.uint8)
    for c in prange(tasks):
        lo, hi = c * chunk, min(c * chunk + chunk, n)
        m = np.empty(INT8_BLOCK, dtype=np.float32)
        v = np.empty(INT8_BLOCK, dtype=np.float32)
        tie = np.empty(INT8_BLOCK, dtype=np.uint8)
        r = np.searchsorted(starts, lo, side="right") - 1  # the run holding lo (or an empty one before it)
        acc = np.uint32(0)
        for b in range(lo, hi, INT8_BLOCK):
            e = min(b + INT8_BLOCK, hi)
            k = b // INT8_BLOCK
            _int8_dequantize(m_q[b:e], v_q[b:e], m_scale[k], v_scale[k], smap, umap, m, v)
            i = b
            while i < e:
                while starts[r + 1] <= i:
                    r += 1
                z = min(e, starts[r + 1])
                fac = decay if decayed[r] != 0 else np.float32(1.0)
                acc |= _int8_update(
                    first[i:z], w[i:z], v_q[i:z], g[i:z], fac, gscale, m_w, b2, v_w, bc2_sqrt, eps, neg_step,
                    m[i - b : z - b], v[i - b : z - b], tie[i - b : z - b],
                )  # fmt: skip
                i = z
            ms, vs = _abs_max(m[: e - b]), _abs_max(v[: e - b])
            m_scale[k] = ms
            v_scale[k] = vs
            _int8_quantize(m_q[b:e], v_q[b:e], m[: e - b], v[: e - b], tie, ms, vs, sbuck, smid, ubuck, umid, umap)
        bad[c] = acc != 0
    return not bad.any()


# ---- sum of squares (a gradient's contribution to the global norm) ----


@njit(parallel=True, nogil=True, cache=True, fastmath={"reassoc", "contract"})
def sum_squares(g: np.ndarray, chunk: int) -> float:
    """Σ g² in float64 over a float32 array or a uint16 array of bf16 bits.

    Each ``chunk``-element task sums in float64 (reassociation allowed so LLVM vectorises; the
    order is fixed by the compiled code, so a result is reproducible on one machine), the tasks'
    sums are added in index order. NaN or infinity anywhere gives a non-finite result.
    """
    n = g.size
    tasks = (n + chunk - 1) // chunk
    part = np.zeros(tasks, dtype=np.float64)
    for c in prange(tasks):
        lo = c * chunk
        hi = min(n, lo + chunk)
        acc = 0.0
        for i in range(lo, hi):
            x = np.float64(load_f32(g, i))
            acc += x * x
        part[c] = acc
    total = 0.0
    for c in range(tasks):
        total += part[c]
    return total
