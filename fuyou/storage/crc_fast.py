"""CRC32C at about three times the ``crc32c`` package's speed: three interleaved hardware CRC streams.

The x86 ``crc32`` instruction (SSE4.2) has a latency of 3 cycles and a throughput of 1 per cycle, so
one dependent chain over a buffer, as the ``crc32c`` package computes it, runs at a third of what
the core can do (~6 GB/s on a 2.5 GHz Zen). Here a buffer is cut into 12 KiB *strides*; each stride
is three 4 KiB lanes whose CRCs run as three independent chains, then are joined with the linear
"shift by 4096 zero bytes" map (four 256-entry tables, computed once at import), so the result is
the same CRC32C (Castagnoli, reflected, init and final XOR 0xFFFFFFFF) as ``crc32c.crc32c``, bit for
bit. The tail shorter than a stride goes 8 bytes, then 1 byte, at a time.

``available()`` says whether this path runs here (x86-64 with SSE4.2, numba importable);
``fuyou.storage.checksum.crc`` falls back to the ``crc32c`` package otherwise. The kernel releases
the GIL (``nogil``), like the package. Compiled on first use and cached on disk (``cache=True``:
all jitted code of this path lives in this one file, as numba's cache only checks the source file
of the cached function).
"""

from __future__ import annotations

import platform

import numpy as np

LANE = 4096
"""Bytes per interleaved lane; a stride is three lanes."""
STRIDE = 3 * LANE

_X86_64 = platform.machine().lower() in ("x86_64", "amd64")


def _host_has_sse42() -> bool:
    try:
        from llvmlite import binding

        return bool(binding.get_host_cpu_features().get("sse4.2", False))
    except (ImportError, RuntimeError, AttributeError):
        return False


_ENABLED = _X86_64 and _host_has_sse42()

if _ENABLED:
    from llvmlite import ir
    from numba import njit, types
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    @intrinsic
    def _crc_u64(typingctx, crc, word):
        """One ``crc32 r64, r64`` step: the raw (un-inverted) CRC32C state after 8 more bytes."""
        sig = types.uint64(types.uint64, types.uint64)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse42.crc32.64.64")
            return builder.call(fn, args)

        return sig, codegen

    @intrinsic
    def _crc_u8(typingctx, crc, byte):
        """One ``crc32 r32, r8`` step: the raw CRC32C state after 1 more byte."""
        sig = types.uint32(types.uint32, types.uint8)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), ir.IntType(8)])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse42.crc32.32.8")
            return builder.call(fn, args)

        return sig, codegen

    @intrinsic
    def _load_u64(typingctx, arr, index):
        """The 8 bytes of a uint8 array at ``index`` as a little-endian uint64 (unaligned load)."""
        sig = types.uint64(arr, types.intp)

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.gep(ary.data, [args[1]])
            p64 = builder.bitcast(ptr, ir.IntType(64).as_pointer())
            return builder.load(p64, align=1)

        return sig, codegen

    @njit(nogil=True, cache=True)
    def _shift(state, tables):
        """The raw CRC state ``state`` advanced over ``LANE`` zero bytes (a linear map, by tables)."""
        s = np.uint32(state)
        return (
            tables[0, s & 0xFF] ^ tables[1, (s >> 8) & 0xFF] ^ tables[2, (s >> 16) & 0xFF] ^ tables[3, (s >> 24) & 0xFF]
        )

    @njit(nogil=True, cache=True)
    def _crc32c_kernel(buf, tables):
        """CRC32C of the uint8 array ``buf`` (see the module docstring)."""
        n = buf.size
        s = np.uint64(0xFFFFFFFF)
        pos = 0
        while pos + STRIDE <= n:
            a, b, c = s, np.uint64(0), np.uint64(0)
            for i in range(pos, pos + LANE, 8):
                a = _crc_u64(a, _load_u64(buf, i))
                b = _crc_u64(b, _load_u64(buf, i + LANE))
                c = _crc_u64(c, _load_u64(buf, i + 2 * LANE))
            s = np.uint64(_shift(np.uint64(_shift(a, tables)) ^ b, tables)) ^ c
            pos += STRIDE
        while pos + 8 <= n:
            s = _crc_u64(s, _load_u64(buf, pos))
            pos += 8
        s32 = np.uint32(s)
        while pos < n:
            s32 = _crc_u8(s32, buf[pos])
            pos += 1
        return np.uint32(~s32)

    @njit(nogil=True, cache=True)
    def _zeros_shift(state):
        """The raw CRC state ``state`` advanced over ``LANE`` zero bytes, the slow way (for the tables)."""
        s = np.uint64(state)
        for _ in range(LANE // 8):
            s = _crc_u64(s, np.uint64(0))
        return np.uint32(s)

    def _make_tables() -> np.ndarray:
        """Tables[k, byte] = the ``LANE``-zero-byte shift of ``byte << 8k`` (the map is linear over GF(2))."""
        basis = [int(_zeros_shift(np.uint64(1 << bit))) for bit in range(32)]
        tables = np.zeros((4, 256), dtype=np.uint32)
        for k in range(4):
            for byte in range(256):
                acc = 0
                for bit in range(8):
                    if byte >> bit & 1:
                        acc ^= basis[8 * k + bit]
                tables[k, byte] = acc
        return tables

    _TABLES = _make_tables()


def available() -> bool:
    """Whether the interleaved kernel runs on this machine (x86-64 with SSE4.2 and numba)."""
    return _ENABLED


def crc32c(buf: np.ndarray) -> int:
    """CRC32C of a 1-D, C-contiguous uint8 array (releases the GIL), equal to ``crc32c.crc32c``.

    Raises RuntimeError if ``available()`` is false, ValueError if ``buf`` is not a contiguous
    uint8 vector.
    """
    if not _ENABLED:
        raise RuntimeError("the interleaved CRC32C kernel needs x86-64 with SSE4.2")
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError("crc_fast.crc32c needs a contiguous 1-D uint8 array")
    return int(_crc32c_kernel(buf, _TABLES))
