"""The small-state option: m and v stored in bf16, rounded to nearest even after the update."""

from __future__ import annotations

import torch

from fuyou.optim import AdamWHyper, adamw_step, adamw_step_reference

from .helpers import assert_bits_equal, make_grads, make_state

HYPER = AdamWHyper(weight_decay=0.01)


def run(step_fn, state_dtype, grads, n):  # type: ignore[no-untyped-def]
    master, m, v = make_state(n, state_dtype)
    for s, g in enumerate(grads, start=1):
        step_fn(master, m, v, g.to(torch.bfloat16), lr=1e-3, step=s, hyper=HYPER)
    return master, m, v


def test_bf16_state_kernel_equals_reference_bitwise() -> None:
    n = 4097
    grads = make_grads(n, 6)
    for name, a, b in zip(("master", "m", "v"), run(adamw_step, torch.bfloat16, grads, n),
                          run(adamw_step_reference, torch.bfloat16, grads, n)):  # fmt: skip
        assert a.dtype == b.dtype
        assert_bits_equal(a, b, name)


def test_bf16_state_is_the_rounded_fp32_update() -> None:
    """A step from bf16 m, v equals the fp32-state step from their widened values, rounded."""
    n = 10_000
    master, m, v = make_state(n, torch.bfloat16)
    adamw_step(master, m, v, make_grads(n, 1)[0], lr=1e-3, step=1)  # non-zero m, v
    g = make_grads(n, 2, seed=5)[1]
    small = [master.clone(), m.clone(), v.clone()]
    wide = [master.clone(), m.float(), v.float()]
    adamw_step(*small, g, lr=1e-3, step=2)
    adamw_step(*wide, g, lr=1e-3, step=2)
    assert_bits_equal(small[0], wide[0], "master")
    assert_bits_equal(small[1], wide[1].to(torch.bfloat16), "m")
    assert_bits_equal(small[2], wide[2].to(torch.bfloat16), "v")


def test_bf16_state_tracks_fp32_state_loosely() -> None:
    """Over 20 steps the weight change with bf16 m/v stays within a few % of the fp32-state one."""
    n, steps = 50_000, 20
    gen = torch.Generator().manual_seed(7)
    signal = torch.randn(n, generator=gen)
    grads = [signal + 0.5 * torch.randn(n, generator=gen) for _ in range(steps)]
    start = make_state(n)[0]
    wide = run(adamw_step, torch.float32, grads, n)
    small = run(adamw_step, torch.bfloat16, grads, n)
    d_wide, d_small = wide[0] - start, small[0] - start
    rel = (d_small - d_wide).norm() / d_wide.norm()
    assert rel < 0.03, f"bf16-state update differs by {rel:.3%} from fp32 state"
    assert not torch.equal(d_small, d_wide)  # the bf16 rounding really happened
