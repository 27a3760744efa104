"""The numba kernel and the reference against torch.optim.AdamW, over 6 steps with a changing lr."""

from __future__ import annotations

import pytest
import torch

from fuyou.optim import AdamWHyper, adamw_step, adamw_step_reference

from .helpers import LRS, assert_bits_equal, assert_rel_close, make_grads, make_state, torch_adamw

N = 100_003
STEPS = 6


def run_ours(  # type: ignore[no-untyped-def]
    step_fn, master, grads, hyper, grad_dtype=torch.float32, grad_scale=1.0, out=None
):
    """Run ``step_fn`` for len(grads) steps on copies; return (master, m, v)."""
    p, m, v = master.clone(), torch.zeros_like(master), torch.zeros_like(master)
    for s, (g, lr) in enumerate(zip(grads, LRS), start=1):
        g = g.to(grad_dtype)
        step_fn(p, m, v, g, lr=lr, step=s, hyper=hyper, grad_scale=grad_scale, out=out)
    return p, m, v


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("fused", [None, True], ids=["torch-default", "torch-fused"])
def test_fp32_grads_match_torch_adamw(weight_decay: float, fused: bool | None) -> None:
    hyper = AdamWHyper(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay)
    master, _, _ = make_state(N)
    grads = make_grads(N, STEPS)
    expected = torch_adamw(master, grads, hyper, fused)
    for ours, exp in zip(run_ours(adamw_step, master, grads, hyper), expected):
        assert_rel_close(ours, exp, rtol=1e-6)


def test_bf16_grads_match_torch_fed_rounded_grads() -> None:
    hyper = AdamWHyper(weight_decay=0.01)
    master, _, _ = make_state(N)
    grads = make_grads(N, STEPS)
    rounded = [g.to(torch.bfloat16).float() for g in grads]
    expected = torch_adamw(master, rounded, hyper, fused=None)
    ours = run_ours(adamw_step, master, grads, hyper, grad_dtype=torch.bfloat16)
    for a, e in zip(ours, expected):
        assert_rel_close(a, e, rtol=1e-6)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_grad_scale_matches_torch_on_scaled_grads(grad_dtype: torch.dtype) -> None:
    hyper = AdamWHyper(weight_decay=0.01)
    scale = 0.37
    master, _, _ = make_state(N)
    grads = make_grads(N, STEPS)
    scaled = [g.to(grad_dtype).float() * scale for g in grads]
    expected = torch_adamw(master, scaled, hyper, fused=None)
    ours = run_ours(adamw_step, master, grads, hyper, grad_dtype=grad_dtype, grad_scale=scale)
    for a, e in zip(ours, expected):
        assert_rel_close(a, e, rtol=1e-6)
    unscaled = run_ours(adamw_step, master, grads, hyper, grad_dtype=grad_dtype)
    assert not torch.equal(unscaled[1], ours[1])  # the scale really reached m


def test_other_betas_and_eps_match_torch() -> None:
    hyper = AdamWHyper(beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
    master, _, _ = make_state(4097)
    grads = make_grads(4097, STEPS)
    expected = torch_adamw(master, grads, hyper, fused=None)
    for a, e in zip(run_ours(adamw_step, master, grads, hyper), expected):
        assert_rel_close(a, e, rtol=1e-6)


@pytest.mark.parametrize("n", [1, 7, 4097, (1 << 20) + 3])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_bitwise(n: int, grad_dtype: torch.dtype) -> None:
    hyper = AdamWHyper(weight_decay=0.02)
    master, _, _ = make_state(n)
    grads = make_grads(n, STEPS)
    out_k, out_r = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    ours = run_ours(adamw_step, master, grads, hyper, grad_dtype, 0.5, out_k)
    ref = run_ours(adamw_step_reference, master, grads, hyper, grad_dtype, 0.5, out_r)
    for name, a, r in zip(("master", "m", "v"), ours, ref):
        assert_bits_equal(a, r, name)
    assert_bits_equal(out_k, out_r, "bf16 out")
    fed = [g.to(grad_dtype).float() * 0.5 for g in grads]
    assert_rel_close(ours[0], torch_adamw(master, fed, hyper, None)[0])


def test_lr_zero_and_wd_zero_leave_master_unchanged() -> None:
    master, m, v = make_state(1000)
    before = master.clone()
    adamw_step(master, m, v, make_grads(1000, 1)[0], lr=0.0, step=1)
    assert_bits_equal(master, before, "master")
    assert m.abs().sum() > 0 and v.abs().sum() > 0
