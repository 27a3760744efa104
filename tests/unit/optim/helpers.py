"""Shared helpers for the optimizer tests: buffers, bitwise comparison, torch.optim.AdamW runs."""

from __future__ import annotations

import torch

from fuyou.optim import AdamWHyper

LRS = (1e-3, 3e-3, 5e-4, 2e-3, 1e-4, 7e-4)
"""A learning rate per step that changes every step (6 steps)."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of an fp32/bf16 tensor as integers (NaN-safe exact comparison)."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Assert two tensors are bit-identical, reporting how many elements differ."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    diff = (bits(a) != bits(b)).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-6) -> None:
    """|a - e| <= rtol * |e| elementwise, with a floor of rtol * 1e-3 * max|e| for values near 0."""
    floor = rtol * 1e-3 * expected.abs().max().item()
    err = (actual.double() - expected.double()).abs()
    bound = rtol * expected.double().abs() + floor
    worst = (err - bound).max().item()
    assert worst <= 0, f"max rel err {(err / expected.double().abs().clamp_min(1e-30)).max():.3g}"


def make_grads(n: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """fp32 gradients spanning 7 decades of magnitude, both signs, a few exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-6, 1, generator=gen)
        g[::97] = 0.0
        out.append(g)
    return out


def make_state(n: int, state_dtype: torch.dtype = torch.float32, seed: int = 1) -> list[torch.Tensor]:
    """(master, m, v): a random fp32 master and zero moments, as at the start of training."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    return [master, torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)]


def torch_adamw(
    master: torch.Tensor, grads: list[torch.Tensor], hyper: AdamWHyper, fused: bool | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.optim.AdamW for len(grads) steps with ``LRS``; return (param, exp_avg, exp_avg_sq)."""
    p = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW(
        [p], lr=LRS[0], betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
        weight_decay=hyper.weight_decay, fused=fused,
    )  # fmt: skip
    for g, lr in zip(grads, LRS):
        opt.param_groups[0]["lr"] = lr
        p.grad = g.clone()
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]
