"""The split master (``fuyou.optim.split``): bf16 weight + int16 remainder + a tie flag in v's sign bit
equals the fp32 master bit for bit — encoding, decoding, and AdamW steps on it."""

from __future__ import annotations

import pytest
import torch

from fuyou.optim import (
    AdamWHyper,
    OptimBufferError,
    adamw_split_step,
    adamw_split_step_reference,
    adamw_step,
    split_decode,
    split_encode,
)
from fuyou.optim.split import put_flag, take_flag

from .helpers import LRS, assert_bits_equal, make_grads

HYPER = AdamWHyper(weight_decay=0.01)

# High halves (bf16 bit patterns) where rounding is delicate: zero, the smallest subnormals, the top of the
# subnormals and the first normal (a carry into the exponent), 1.0's neighbours, the largest finite bf16 (a
# carry to infinity), infinity, and the same negated; even and odd.
HIGHS = [0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x3F7F, 0x3F80, 0x3F81, 0x4000, 0x7F7E, 0x7F7F, 0x7F80]
HIGHS += [h | 0x8000 for h in HIGHS]


def patterns(highs: list[int]) -> torch.Tensor:
    """Every fp32 whose high half is in ``highs``: all 65,536 low halves of each."""
    hi = torch.tensor(highs, dtype=torch.int64)[:, None] << 16
    bits = (hi + torch.arange(1 << 16, dtype=torch.int64)[None, :]).reshape(-1)
    return (bits - ((bits & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


def u32(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).long() & 0xFFFFFFFF


def test_round_trip_every_low_half_of_the_delicate_high_halves() -> None:
    x = patterns(HIGHS)
    x = x[~x.isnan()]
    w, rem, flag = split_encode(x)
    assert_bits_equal(w, x.to(torch.bfloat16), "w is torch's round to nearest even")
    assert_bits_equal(split_decode(w, rem, flag), x, "decoded master")


def test_the_flag_marks_exactly_the_ties_rounded_down_to_an_even_weight() -> None:
    x = patterns(HIGHS)
    x = x[~x.isnan()]
    w, rem, flag = split_encode(x)
    b = u32(x)
    tie_down = ((b & 0xFFFF) == 0x8000) & (((b >> 16) & 1) == 0)
    assert torch.equal(flag, tie_down)
    assert int(tie_down.sum()) > 0
    assert bool((rem[flag] == -(1 << 15)).all()), "a flagged element's code is -2^15"
    # the two ties of an even weight share the code -2^15; only the flag tells them apart
    even_w = (w.view(torch.int16).long() & 1) == 0
    assert int(((rem == -(1 << 15)) & ~flag & even_w).sum()) > 0


def test_nan_decodes_as_nan_and_infinity_exactly() -> None:
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e38, -3.3e38], dtype=torch.float32)
    w, rem, flag = split_encode(x)
    back = split_decode(w, rem, flag)
    assert back[0].isnan()
    assert_bits_equal(back[1:], x[1:], "inf and the largest finite values (some round to inf)")


def test_flags_live_in_the_sign_bits_of_v() -> None:
    for dt in (torch.float32, torch.bfloat16):
        v = torch.tensor([0.0, 1.5, 2e-30, 0.0], dtype=dt)
        flag = torch.tensor([True, False, True, False])
        keep = v.clone()
        put_flag(v, flag)
        assert bool((v[flag] <= 0).all()) and torch.signbit(v).tolist() == flag.tolist()
        back, got = take_flag(v)
        assert torch.equal(got, flag)
        assert_bits_equal(back, keep, f"v {dt}")


def split_state(master: torch.Tensor, moments: torch.dtype) -> list[torch.Tensor]:
    """(rem, m, v, w) of ``master`` with zero moments, flags in v."""
    w, rem, flag = split_encode(master)
    v = torch.zeros(master.numel(), dtype=moments)
    put_flag(v, flag)
    return [rem, torch.zeros(master.numel(), dtype=moments), v, w]


def masters(n: int, seed: int = 3) -> torch.Tensor:
    """Random fp32 masters, with ties (both parities), binade edges and subnormals mixed in."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    special = patterns([0x3F7F, 0x3F80, 0x0080, 0xBF80, 0x0001])
    special = special[u32(special) % 4096 == 0x8000 % 4096]  # every tie, and the low halves 0x0000/0xF000/...
    x[: special.numel()] = special[:n]
    return x


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_split_steps_equal_the_fp32_master_steps_bit_for_bit(moments: torch.dtype, grad_dtype: torch.dtype) -> None:
    n = 5000
    master = masters(n)
    rem, m, v, w = split_state(master, moments)
    ref = [master.clone(), torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)]
    ref_out = torch.empty(n, dtype=torch.bfloat16)
    for s, (g, lr) in enumerate(zip(make_grads(n, 6), LRS), start=1):
        g = g.to(grad_dtype)
        assert adamw_split_step(rem, m, v, g, lr=lr, step=s, hyper=HYPER, grad_scale=0.7, out=w)
        adamw_step(*ref, g, lr=lr, step=s, hyper=HYPER, grad_scale=0.7, out=ref_out)
        v_abs, flag = take_flag(v)
        assert_bits_equal(split_decode(w, rem, flag), ref[0], f"master after step {s}")
        assert_bits_equal(w, ref_out, f"weights after step {s}")
        assert_bits_equal(m, ref[1], "m")
        assert_bits_equal(v_abs, ref[2], "v")


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_numba_split_kernel_equals_the_reference(moments: torch.dtype) -> None:
    n = 4099  # not a multiple of the kernel's blocks
    a = split_state(masters(n, seed=8), moments)
    b = [t.clone() for t in a]
    for s, g in enumerate(make_grads(n, 4, seed=2), start=1):
        adamw_split_step(*a[:3], g, lr=2e-3, step=s, hyper=HYPER, out=a[3], chunk=1000)
        adamw_split_step_reference(*b[:3], g, lr=2e-3, step=s, hyper=HYPER, out=b[3])
    for name, x, y in zip(("rem", "m", "v", "w"), a, b):
        assert torch.equal(raw(x), raw(y)), name


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bits of a 2- or 4-byte tensor as integers."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_lr_zero_is_the_identity_on_every_delicate_pattern() -> None:
    """With lr 0 and zero moments an update changes nothing: the kernel's own split and join round-trip."""
    x = patterns(HIGHS)
    x = x[~x.isnan() & (u32(x) != 0x80000000)]  # -0.0 + 0.0 is +0.0 in any AdamW
    rem, m, v, w = split_state(x, torch.float32)
    w0, rem0, v0 = w.clone(), rem.clone(), v.clone()
    adamw_split_step(rem, m, v, torch.zeros_like(x), lr=0.0, step=1, out=w)
    assert torch.equal(w.view(torch.int16), w0.view(torch.int16))
    assert torch.equal(rem, rem0)
    assert torch.equal(v.view(torch.int32), v0.view(torch.int32))


def test_a_non_finite_update_is_reported() -> None:
    rem, m, v, w = split_state(torch.ones(64), torch.float32)
    g = torch.ones(64)
    g[5] = float("nan")
    assert adamw_split_step(rem, m, v, g, lr=1e-3, step=1, out=w) is False


def test_bad_buffers_are_refused() -> None:
    rem, m, v, w = split_state(torch.ones(8), torch.float32)
    with pytest.raises(OptimBufferError, match="rem"):
        adamw_split_step(rem.float(), m, v, torch.ones(8), lr=1e-3, step=1, out=w)
    with pytest.raises(OptimBufferError, match="out"):
        adamw_split_step(rem, m, v, torch.ones(8), lr=1e-3, step=1, out=w.float())


@pytest.mark.slow
def test_round_trip_every_low_half_of_every_31st_high_half() -> None:
    """2,114 high halves (every 31st: both parities, every binade of both signs) × all 65,536 low halves
    (all 2³² take 30 min here): encode/decode (torch) and the kernel's identity step."""
    highs = list(range(0, 1 << 16, 31))
    for start in range(0, len(highs), 256):
        x = patterns(highs[start : start + 256])
        x = x[~x.isnan() & (u32(x) != 0x80000000)]
        w, rem, flag = split_encode(x)
        assert torch.equal(split_decode(w, rem, flag).view(torch.int32), x.view(torch.int32)), hex(start)
        r, m, v, w2 = split_state(x, torch.bfloat16)
        adamw_split_step(r, m, v, torch.zeros_like(x), lr=0.0, step=1, out=w2)
        assert torch.equal(r, rem) and torch.equal(w2.view(torch.int16), w.view(torch.int16)), hex(start)
