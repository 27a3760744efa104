"""8-bit block-wise moments beside the split or fp32 master (``fuyou.optim.quant8``): the numba kernel equals the
plain reference bit for bit, the master stays exact through forced bf16 ties, both track a float64 oracle of
the same scheme, and the maps and the quantizer have the properties the format relies on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit, prange

from fuyou.errors import ConfigError
from fuyou.optim import (
    AdamWHyper,
    OptimBufferError,
    adamw_int8_step,
    adamw_int8_step_reference,
    adamw_step_reference,
    int8_from_fp32,
    quant8 as q8,
    split_decode,
    split_encode,
)
from fuyou.optim.numba_kernel import INT8_BLOCK, _code_lookup, code_buckets, code_indices, f32_from_bits
from fuyou.optim.split import put_flag

from .helpers import LRS, make_grads
from .test_split import HIGHS, masters, patterns, raw, u32

HYPER = AdamWHyper(weight_decay=0.1)
TIE = q8.TIE_CODE


def flags_of(rem: torch.Tensor, v_q: torch.Tensor) -> torch.Tensor:
    """The split master's tie flags as the int8 format keeps them: v code parity where rem is the tie code."""
    return (rem == TIE) & ((v_q & 1) != 0)


def int8_state(master: torch.Tensor, split: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """``([rem_or_master, m_q, v_q, m_scale, v_scale], out)`` of ``master`` with zero moments."""
    n = master.numel()
    zeros = torch.zeros(n)
    if not split:
        return [master.clone(), *int8_from_fp32(zeros, zeros)], None
    w, rem, flag = split_encode(master)
    v = zeros.clone()
    put_flag(v, flag)
    m_q, v_q, m_scale, v_scale = int8_from_fp32(zeros, v, rem=rem)
    assert torch.equal(flags_of(rem, v_q), flag)
    return [rem, m_q, v_q, m_scale, v_scale], w


def master_of(state: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    """The fp32 master a state holds."""
    if out is None:
        return state[0]
    return split_decode(out, state[0], flags_of(state[0], state[2]))


def random_runs(n: int, gen: torch.Generator) -> list[tuple[int, int, bool]]:
    """A few runs covering [0, n), alternately decayed, one of them empty, boundaries off the blocks."""
    cuts = sorted({0, n, *torch.randint(0, n + 1, (4,), generator=gen).tolist()})
    runs = [(a, z, i % 2 == 0) for i, (a, z) in enumerate(zip(cuts, cuts[1:]))]
    return runs[:1] + [(runs[0][1], runs[0][1], True)] + runs[1:] if runs else []


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- (a) the kernel equals the reference bit for bit ----


@pytest.mark.parametrize("split", [True, False], ids=["split", "fp32"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "g16"])
def test_kernel_equals_the_reference_bit_for_bit(split: bool, grad_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    for n in (0, 1, 100, 255, 256, 257, 1000, 4099):
        a, out_a = int8_state(masters(n, seed=n), split)
        b = [t.clone() for t in a]
        out_b = None if out_a is None else out_a.clone()
        runs = random_runs(n, gen)
        for s, g in enumerate(make_grads(n, 3, seed=n), start=1):
            g[256:768] = 0.0  # blocks 1 and 2 stay all zero: zero scales
            g = g.to(grad_dtype)
            kw = dict(lr=LRS[s], step=s, hyper=HYPER, grad_scale=0.7 if s != 2 else 1.0, runs=runs)
            fa = adamw_int8_step(*a, g, out=out_a, chunk=512, **kw)  # type: ignore[arg-type]
            fb = adamw_int8_step_reference(*b, g, out=out_b, **kw)  # type: ignore[arg-type]
            assert fa is True and fb is True
            for name, x, y in zip(("first", "m_q", "v_q", "m_scale", "v_scale"), a, b):
                assert same_bits(x, y), f"n={n} step {s}: {name} differs"
            if out_a is not None and out_b is not None:
                assert same_bits(out_a, out_b), f"n={n} step {s}: w differs"
        if n > 768:
            assert bool((a[3][1:3] == 0).all() & (a[4][1:3] == 0).all()), "all-zero blocks keep zero scales"


def test_the_result_does_not_depend_on_the_chunk() -> None:
    n = 3000
    results = []
    for chunk in (256, 1024, INT8_BLOCK * 128):
        st, out = int8_state(masters(n, seed=1), True)
        for s, g in enumerate(make_grads(n, 2, seed=4), start=1):
            adamw_int8_step(*st, g, lr=1e-3, step=s, hyper=HYPER, out=out, runs=[(0, n, True)], chunk=chunk)
        results.append([*st, out])
    for other in results[1:]:
        assert all(same_bits(x, y) for x, y in zip(results[0], other))


def test_the_kernel_block_is_the_format_block() -> None:
    assert INT8_BLOCK == q8.BLOCK == 256
    assert [q8.n_blocks(n) for n in (0, 1, 256, 257, 512)] == [0, 1, 1, 2, 2]


# ---- (b) forced ties: the master stays exact ----


def fp32_reference_step(
    master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, runs: list, **kw: object
) -> None:
    """``adamw_step_reference`` run by run: weight decay on the decayed runs only."""
    for a, z, decay in runs:
        hyper = HYPER if decay else AdamWHyper(weight_decay=0.0)
        adamw_step_reference(master[a:z], m[a:z], v[a:z], g[a:z], hyper=hyper, **kw)  # type: ignore[arg-type]


def tie_targets(n: int) -> torch.Tensor:
    """fp32 bf16 ties (low half 0x8000) over the delicate high halves: both parities, the carry into the
    exponent (0x3F7F, odd, rounds up to 1.0) and the carry to infinity (0x7F7F), both signs."""
    highs = [h for h in HIGHS if (h & 0x7F80) not in (0x0000, 0x7F80)]  # normal binades, finite
    highs += [0x3F7E, 0x4040, 0x4041, 0xBF7F, 0xC040]
    hi = torch.tensor(highs, dtype=torch.int64)[torch.arange(n) % len(highs)]
    bits = (hi << 16) | 0x8000
    return (bits - ((bits & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "g16"])
def test_updates_landing_on_bf16_ties_keep_the_master_exact(grad_dtype: torch.dtype) -> None:
    """An update ``u`` does not depend on the master, so a master ``T - u`` (to within T's ulp) lands exactly on the
    tie T. Checked: the decoded master equals ``adamw_step_reference`` on the fp32 master from the same dequantized
    old moments, bit for bit, ties (both flags) and exponent carries included."""
    n, half = 6000, 3000  # [0, half): decayed, random masters; [half, n): no decay, forced ties
    runs = [(0, half, True), (half, n, False)]
    st, out = int8_state(masters(n, seed=2), True)
    assert out is not None
    grads = [g.to(grad_dtype) for g in make_grads(n, 4, seed=9)]
    tie_count, carries, flagged = 0, 0, 0
    for s, g in enumerate(grads, start=1):
        kw = dict(lr=LRS[s], step=s, grad_scale=0.9)
        if s >= 2:  # move the master of the no-decay run to T - u
            probe = [torch.zeros(n), *(t.clone() for t in st[1:])]
            adamw_int8_step_reference(*probe, g, hyper=HYPER, out=None, runs=[(0, n, False)], **kw)  # type: ignore[arg-type]
            u = probe[0].double()  # 0 * 1 + u: the update alone
            target = tie_targets(n).double()
            ulp = torch.ldexp(torch.ones(n, dtype=torch.float64), torch.frexp(target)[1] - 24)
            wanted = (target - torch.round(u / ulp) * ulp).float()
            master = master_of(st, out)
            master[half:] = wanted[half:]
            w, rem, flag = split_encode(master)
            out.copy_(w)
            st[0].copy_(rem)
            st[2].copy_(torch.where(rem == TIE, (st[2] & 0xFE) | flag.to(torch.uint8), st[2]))  # flags as parity
        old = master_of(st, out).clone()
        m_old = q8.dequantize(st[1], st[3], signed=True)
        v_old = q8.dequantize(st[2], st[4], signed=False)
        assert adamw_int8_step(*st, g, hyper=HYPER, out=out, runs=runs, **kw)  # type: ignore[arg-type]
        fp32_reference_step(old, m_old, v_old, g, runs, **kw)
        new = master_of(st, out)
        assert torch.equal(raw(new), raw(old)), f"step {s}: {(raw(new) != raw(old)).sum()} masters differ"
        assert torch.equal(raw(out), raw(old.to(torch.bfloat16)))
        assert torch.equal(st[1], q8.quantize_block(m_old, signed=True)[0]), "m codes of the new m"
        ties = st[0][half:] == TIE
        tie_count += int(ties.sum())
        flagged += int(flags_of(st[0], st[2])[half:].sum())
        exponent = (u32(new[half:]) >> 23) & 0xFF
        carries += int((ties & (exponent != ((raw(out[half:]).long() >> 7) & 0xFF))).sum())
    print(f"forced ties: {tie_count} ({flagged} flagged, {carries} exponent carries) of {3 * (n - half)}")
    assert tie_count > 0.5 * 3 * (n - half)
    assert flagged > 0.1 * 3 * (n - half) and carries > 20


def test_lr_zero_is_the_identity_on_every_delicate_pattern() -> None:
    """lr 0, zero gradients: the master does not move, and every tie's flag survives the trip through the
    parity of a requantized v code."""
    x = patterns(HIGHS)
    x = x[~x.isnan()]
    st, out = int8_state(x, True)
    assert out is not None
    w0, rem0, flags0 = out.clone(), st[0].clone(), flags_of(st[0], st[2])
    assert int(flags0.sum()) > 0 and int(((rem0 == TIE) & ~flags0).sum()) > 0
    n = x.numel()
    for s in (1, 2):
        finite = adamw_int8_step(*st, torch.zeros(n), lr=0.0, step=s, hyper=HYPER, out=out, runs=[(0, n, True)])
        assert finite is False, "±inf are among the patterns"
    assert torch.equal(raw(out), raw(w0)) and torch.equal(st[0], rem0)
    assert torch.equal(flags_of(st[0], st[2]), flags0)
    assert torch.equal(raw(master_of(st, out)), raw(x))


# ---- (c) a float64 oracle of the same scheme ----


def oracle_quantize(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """float64 block-wise quantization with the float64 tables: (table indices, scales)."""
    n = x.size
    padded = np.zeros(q8.n_blocks(n) * q8.BLOCK)
    padded[:n] = np.abs(x) if signed else x
    scales = padded.reshape(-1, q8.BLOCK).max(axis=1)
    s = np.repeat(scales, q8.BLOCK)[:n]
    xn = np.divide(x, s, out=np.zeros(n), where=s != 0)
    mid = q8.SIGNED_MID_F64 if signed else q8.UNSIGNED_MID_F64
    return np.searchsorted(mid, xn, side="left"), scales


def oracle_step(p: np.ndarray, m_old: np.ndarray, v_old: np.ndarray, g: np.ndarray, lr: float, step: int,
                decay_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """One AdamW step in float64 (textbook order): ``(p, m, v)``."""
    h = HYPER
    m = h.beta1 * m_old + (1 - h.beta1) * g
    v = h.beta2 * v_old + (1 - h.beta2) * g * g
    denom = np.sqrt(v) / np.sqrt(1 - h.beta2**step) + h.eps
    p = p * np.where(decay_mask, 1 - lr * h.weight_decay, 1.0) - lr / (1 - h.beta1**step) * m / denom
    return p, m, v


@pytest.mark.parametrize("split", [True, False], ids=["split", "fp32"])
def test_twenty_steps_track_a_float64_oracle(split: bool) -> None:
    """Each step, the oracle takes the kernel's old codes and scales (dequantized in float64), updates in
    float64 and quantizes in float64 with the float64 tables; its master is its own, in float64 from the start.

    The moments are synchronised because quantized moment trajectories are chaotic: one code apart (a float32
    rounding near a midpoint), and a later m that nearly cancels lands many codes apart in the dense low
    decades (measured: independent trajectories agree on all but 4e-5 of the codes after 20 steps, but those
    few are up to 22 codes apart). Measured here, per step: at most 2e-5 of the m codes and 4e-5 of the v codes
    differ, by one code (v: the split master's tie parity, about 1 in 2^15, and float32 roundings)."""
    n = 50_000
    runs = [(0, 20_000, True), (20_000, n, False)]
    decay_mask = np.arange(n) < 20_000
    master = torch.randn(n, generator=torch.Generator().manual_seed(7))
    st, out = int8_state(master, split)
    p64 = master.double().numpy()
    size = np.abs(p64)  # the largest |master| along the way: what float32 rounding errors scale with
    for s, g in enumerate(make_grads(n, 20, seed=3), start=1):
        lr = LRS[s % len(LRS)] * 10  # 1e-3 … 3e-2: each step moves the master noticeably
        m_old = q8.SIGNED_MAP_F64[st[1].long().numpy() + 128] * np.repeat(st[3].double().numpy(), q8.BLOCK)[:n]
        v_old = q8.UNSIGNED_MAP_F64[st[2].long().numpy()] * np.repeat(st[4].double().numpy(), q8.BLOCK)[:n]
        p64, m, v = oracle_step(p64, m_old, v_old, g.double().numpy(), lr, s, decay_mask)
        size = np.maximum(size, np.abs(p64))
        assert adamw_int8_step(*st, g, lr=lr, step=s, hyper=HYPER, out=out, runs=runs)
        for name, got, (want, scales), signed in (
            ("m", st[1].long().numpy() + 128, oracle_quantize(m, True), True),
            ("v", st[2].long().numpy(), oracle_quantize(v, False), False),
        ):
            diff = np.abs(got - want)
            assert diff.max() <= 1, f"step {s}: a {name} code {diff.max()} codes from the oracle's"
            assert np.mean(diff != 0) <= 5e-4, f"step {s}: {np.mean(diff != 0):.1e} of the {name} codes differ"
            np.testing.assert_allclose((st[3] if signed else st[4]).double().numpy(), scales, rtol=1e-6)
    rel = np.abs(master_of(st, out).double().numpy() - p64) / size
    assert rel.max() <= 1e-5, f"master relative error {rel.max():.1e}"


# ---- (d) the maps and the quantizer ----


def test_the_maps() -> None:
    for table, mid, t64, m64 in (
        (q8.SIGNED_MAP, q8.SIGNED_MID, q8.SIGNED_MAP_F64, q8.SIGNED_MID_F64),
        (q8.UNSIGNED_MAP, q8.UNSIGNED_MID, q8.UNSIGNED_MAP_F64, q8.UNSIGNED_MID_F64),
    ):
        assert table.dtype == mid.dtype == np.float32 and table.shape == (256,) and mid.shape == (255,)
        assert np.all(np.diff(table) > 0), "strictly increasing"
        assert np.all((table[:-1] < mid) & (mid < table[1:])), "each midpoint between its neighbours"
        assert np.array_equal(table, t64.astype(np.float32)) and np.array_equal(mid, m64.astype(np.float32))
        assert np.array_equal(m64, (t64[:-1] + t64[1:]) / 2)
        assert table[-1] == 1.0
    assert q8.SIGNED_MAP[127] == 0.0 and q8.UNSIGNED_MAP[0] == np.float32(1e-7), "v's map has no zero"
    assert np.array_equal(q8.SIGNED_MAP[:127], -q8.SIGNED_MAP[128:255][::-1]), "symmetric but for 1.0"
    assert q8.SIGNED_MAP[0] == np.float32(-0.99296875) and q8.SIGNED_MAP[0] >= -1.0
    # decades [10^(e-1), 10^e): the dynamic tree's bins per decade
    pos_s, pos_u = q8.SIGNED_MAP_F64[128:255], q8.UNSIGNED_MAP_F64[1:255]
    for e in range(-6, 1):
        assert np.sum((pos_s > 10.0 ** (e - 1)) & (pos_s < 10.0**e)) == 2 ** (e + 6)
        assert np.sum((pos_u > 10.0 ** (e - 1)) & (pos_u < 10.0**e)) == 2 ** (e + 7)
    assert np.isclose(q8.UNSIGNED_MAP_F64[1], 0.1e-6 + 0.9e-6 / 4) and np.isclose(pos_s[0], 0.55e-6)


@pytest.mark.parametrize("signed", [True, False])
def test_a_round_trip_gives_the_nearest_table_value(signed: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    n = 40 * 256 + 17
    x = torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-9, 2, generator=gen)
    x = x if signed else x.abs()
    x[256:512] = 0.0
    codes, scales = q8.quantize_block(x, signed=signed)
    assert codes.dtype == (torch.int8 if signed else torch.uint8) and scales.shape == (q8.n_blocks(n),)
    s = scales.repeat_interleave(256)[:n]
    assert torch.equal(scales, torch.cat([x, torch.zeros(40 * 256 + 256 - n)]).view(-1, 256).abs().amax(1))
    back = q8.dequantize(codes, scales, signed=signed)
    table = torch.tensor(q8.SIGNED_MAP if signed else q8.UNSIGNED_MAP).double()
    xn = torch.where(s == 0, 0.0, x / s).double()  # float32 division, as the format
    index = codes.long() + 128 if signed else codes.long()
    dist = (table[None, :] - xn[:, None]).abs()
    nearest = dist.min(dim=1).values
    chosen = dist.gather(1, index[:, None])[:, 0]
    assert bool((chosen <= nearest + 1e-7 * nearest.clamp_min(1e-30)).all()), "never worse than the nearest"
    assert torch.equal(back, (table[index].float() * s)), "dequantize: table value × scale in float32"
    at_max = x.abs() == s
    assert bool((back[at_max & (x > 0)] == x[at_max & (x > 0)]).all()), "a block's positive absmax is exact"
    assert bool((back[256:512] == 0).all())


def lookup_cases(mid: np.ndarray) -> np.ndarray:
    """float32 values where a count of midpoints below can go wrong: every midpoint and its neighbours (±1, ±2
    ulps), every bucket's first and last value, zeros, ±1, infinities, random values over eleven decades."""
    edges = []
    for sign in (0, 1 << 31):
        for exp in range(96, 129):
            for top in range(128):
                lo = (sign | (exp << 23) | (top << 16)) & 0xFFFFFFFF
                edges += [lo, lo | 0xFFFF]
    near = [np.nextafter(mid, np.float32(d)) for d in (2, -2)]
    near += [np.nextafter(x, np.float32(d)) for x, d in zip(near, (2, -2))]
    rng = np.random.default_rng(0)
    rand = rng.standard_normal(200_000) * 10.0 ** rng.uniform(-10, 0.3, 200_000)
    special = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 2.0**-23, -(2.0**-23), 2.0**-24]
    return np.concatenate([np.array(edges, dtype=np.uint32).view(np.float32), mid, *near, rand, special]).astype(
        np.float32
    )


@pytest.mark.parametrize("signed", [True, False], ids=["m", "v"])
def test_the_kernels_bucket_lookup_is_searchsorted(signed: bool) -> None:
    """The kernel counts midpoints below xn with a bucket table (``numba_kernel.code_buckets``), not a search."""
    mid = q8.SIGNED_MID if signed else q8.UNSIGNED_MID
    x = lookup_cases(mid)
    want = np.searchsorted(mid, x, side="left")
    assert np.array_equal(code_indices(*code_buckets(mid), x), want)


@pytest.mark.slow
def test_the_kernels_bucket_lookup_on_every_float32() -> None:
    """All 2^32 bit patterns but NaNs (about 40 s on 2 cores): the bucket lookup equals a binary search."""
    tables = [(*code_buckets(mid), mid) for mid in (q8.SIGNED_MID, q8.UNSIGNED_MID)]

    @njit(parallel=True)
    def mismatches(buckets, mid_padded, mid):  # type: ignore[no-untyped-def]
        bad = np.zeros(1 << 16, dtype=np.int64)
        for high in prange(1 << 16):
            for low in range(1 << 16):
                x = f32_from_bits(np.uint32((high << 16) | low))
                if x != x:
                    continue
                lo, hi = 0, 255  # the number of midpoints below x, by bisection
                while lo < hi:
                    m = (lo + hi) // 2
                    if mid[m] < x:
                        lo = m + 1
                    else:
                        hi = m
                bad[high] += _code_lookup(buckets, mid_padded, x) != lo
        return bad.sum()

    for buckets, mid_padded, mid in tables:
        assert mismatches(buckets, mid_padded, mid) == 0


def test_int8_from_fp32() -> None:
    zeros = torch.zeros(1000)
    assert all(not t.any() for t in int8_from_fp32(zeros, zeros)), "zeros: zero codes and zero scales"
    m = torch.randn(1000)
    v = torch.rand(1000) * 1e-4
    m_q, v_q, ms, vs = int8_from_fp32(m.bfloat16(), v)
    assert m_q.dtype == torch.int8 and v_q.dtype == torch.uint8 and ms.shape == vs.shape == (4,)
    for back, x, sc in ((q8.dequantize(m_q, ms, signed=True), m.bfloat16().float(), ms),
                        (q8.dequantize(v_q, vs, signed=False), v, vs)):  # fmt: skip
        assert bool(((back - x).abs() <= 0.0071 * sc.repeat_interleave(256)[:1000]).all()), "within half a bin"
    # the split format's flags (v's sign bits) become code parities on the ties
    w, rem, flag = split_encode(masters(1000, seed=4))
    put_flag(v, flag)
    m_q, v_q, _, _ = int8_from_fp32(m, v, rem=rem)
    assert int(flag.sum()) > 0 and torch.equal(flags_of(rem, v_q), flag)


def test_the_reference_fma_is_one_rounding() -> None:
    """``quant8.fma_f32`` (float64 round-to-odd) equals LLVM's fma, also where float64 then float32 rounds twice."""
    from numba import njit

    from fuyou.optim.numba_kernel import fma_f32

    @njit
    def fma_all(a, b, c):  # type: ignore[no-untyped-def]
        out = np.empty_like(a)
        for i in range(a.size):
            out[i] = fma_f32(a[i], b[i], c[i])
        return out

    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 200_000, generator=gen)
    c = -(a.double() * b.double()).float() * (1 + torch.randn(200_000, generator=gen) * 1e-6)  # cancellation
    c[::2] = torch.randn(100_000, generator=gen)
    # (1 + i·2^-12)(1 + j·2^-12) with i, j odd lies exactly on a float32 midpoint; c = ±2^-60·x moves the exact sum
    # off it by less than float64's half ulp, so float64 rounds back onto the midpoint and float32 ties to even
    i, j = (2 * torch.randint(0, 32, (2, 100_000), generator=gen) + 1).double()
    a[:100_000] = (1 + i * 2.0**-12).float()
    b[:100_000] = (1 + j * 2.0**-12).float()
    c[:100_000] = (torch.rand(100_000, generator=gen, dtype=torch.float64) - 0.5) * 2.0**-59
    want = torch.from_numpy(fma_all(a.numpy(), b.numpy(), c.numpy()))
    assert torch.equal(raw(q8.fma_f32(a, b, c)), raw(want))
    twice = (a.double() * b.double() + c.double()).float()
    assert int((raw(twice) != raw(want)).sum()) > 0, "the cases include double roundings"


# ---- (e) non-finite updates ----


@pytest.mark.parametrize("split", [True, False], ids=["split", "fp32"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_is_reported(split: bool, bad: float) -> None:
    n = 600
    for step in (adamw_int8_step, adamw_int8_step_reference):
        st, out = int8_state(torch.ones(n), split)
        g = torch.full((n,), 1e-3)
        g[300] = bad
        assert step(*st, g, lr=1e-3, step=1, out=out, runs=[(0, n, True)]) is False  # type: ignore[operator]
        st, out = int8_state(torch.ones(n), split)
        assert step(*st, torch.full((n,), 1e-3), lr=1e-3, step=1, out=out, runs=[(0, n, True)]) is True  # type: ignore[operator]


# ---- (f) validation ----

N = 300


def bufs(**override: object) -> dict:
    b: dict = {
        "first": torch.zeros(N, dtype=torch.int16), "m_q": torch.zeros(N, dtype=torch.int8),
        "v_q": torch.zeros(N, dtype=torch.uint8), "m_scale": torch.zeros(2), "v_scale": torch.zeros(2),
        "grad": torch.ones(N), "out": torch.ones(N, dtype=torch.bfloat16), "runs": [(0, N, True)],
    }  # fmt: skip
    b.update(override)
    return b


BAD = {
    "fp16 first": (bufs(first=torch.zeros(N, dtype=torch.float16)), OptimBufferError, "rem_or_master: torch.float16"),
    "no out": (bufs(out=None), OptimBufferError, "out: the split master"),
    "out beside fp32": (bufs(first=torch.zeros(N)), OptimBufferError, "pass out=None"),
    "fp32 out": (bufs(out=torch.ones(N)), OptimBufferError, "out: dtype"),
    "uint8 m": (bufs(m_q=torch.zeros(N, dtype=torch.uint8)), OptimBufferError, "m_q: dtype"),
    "int8 v": (bufs(v_q=torch.zeros(N, dtype=torch.int8)), OptimBufferError, "v_q: dtype"),
    "short v": (bufs(v_q=torch.zeros(N - 1, dtype=torch.uint8)), OptimBufferError, "v_q: 299 elements"),
    "short scale": (bufs(m_scale=torch.zeros(1)), OptimBufferError, "m_scale: 1 elements, expected 2 .one per 256"),
    "bf16 scale": (bufs(v_scale=torch.zeros(2, dtype=torch.bfloat16)), OptimBufferError, "v_scale: dtype"),
    "fp64 grad": (bufs(grad=torch.ones(N, dtype=torch.float64)), OptimBufferError, "grad: dtype"),
    "strided m": (bufs(m_q=torch.zeros(2 * N, dtype=torch.int8)[::2]), OptimBufferError, "flat contiguous"),
    "runs short": (bufs(runs=[(0, 200, True)]), OptimBufferError, r"runs: cover \[0, 200\)"),
    "runs gap": (bufs(runs=[(0, 100, True), (101, N, False)]), OptimBufferError, r"runs\[1\]: \(101, 300\)"),
    "runs backwards": (bufs(runs=[(0, 100, True), (100, 50, False)]), OptimBufferError, r"runs\[1\]"),
    "runs int flag": (bufs(runs=[(0, N, 1)]), OptimBufferError, r"runs\[0\].*decay: bool"),
    "runs not triples": (bufs(runs=[(0, N)]), OptimBufferError, r"runs\[0\]"),
    "runs a dict": (bufs(runs={0: N}), OptimBufferError, "runs: expected a sequence"),
    "runs empty": (bufs(runs=[]), OptimBufferError, r"runs: cover \[0, 0\)"),
    "chunk 300": (bufs(chunk=300), ConfigError, "chunk=300 must be a multiple of 256"),
    "chunk 0": (bufs(chunk=0), ConfigError, "chunk=0"),
    "lr": (bufs(lr=-1.0), ConfigError, "lr=-1.0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_raise_before_any_write(case: str) -> None:
    b, error, message = BAD[case]
    lr = b.pop("lr", 1e-3)
    chunk = b.pop("chunk", None)
    first, out = b["first"], b["out"]
    before = [t.clone() for t in (first, b["m_q"], b["v_q"], b["m_scale"], b["v_scale"])]
    args = (first, b["m_q"], b["v_q"], b["m_scale"], b["v_scale"], b["grad"])
    extra = {} if chunk is None else {"chunk": chunk}
    with pytest.raises(error, match=message):
        adamw_int8_step(*args, lr=lr, step=1, out=out, runs=b["runs"], **extra)
    if chunk is None:
        with pytest.raises(error, match=message):
            adamw_int8_step_reference(*args, lr=lr, step=1, out=out, runs=b["runs"])
    for x, y in zip(before, (first, b["m_q"], b["v_q"], b["m_scale"], b["v_scale"])):
        assert torch.equal(x, y)


def test_overlapping_buffers_raise() -> None:
    big = torch.zeros(2 * N, dtype=torch.int8)
    b = bufs()
    with pytest.raises(OptimBufferError, match="overlap"):
        adamw_int8_step(b["first"], big[:N], big[N // 2 : N // 2 + N].view(torch.uint8), b["m_scale"],
                        b["v_scale"], b["grad"], lr=1e-3, step=1, out=b["out"], runs=b["runs"])  # fmt: skip
