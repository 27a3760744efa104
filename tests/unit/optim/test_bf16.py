"""bf16 conversion: the kernel's bf16 copy is bit-identical to ``.to(torch.bfloat16)``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from fuyou.optim import adamw_step, adamw_step_reference
from fuyou.optim.numba_kernel import BF16_NAN_BITS, f32_to_bf16_bits

from .helpers import assert_bits_equal

SPECIAL_BITS = [
    0x00000000, 0x80000000,  # +-0
    0x00000001, 0x00008000, 0x00018000, 0x00017FFF, 0x00028000, 0x807FFFFF,  # subnormals, ties
    0x007FFFFF, 0x00800000,  # largest subnormal, smallest normal
    0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0xBF808000,  # ties to even, just below/above
    0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,  # round up into infinity
    0x7F800000, 0xFF800000,  # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF, 0x7FFF0000,  # quiet/signalling NaN
]  # fmt: skip


@njit(cache=False)  # not cached: numba would not see changes to the inlined helper
def _convert(x: np.ndarray) -> np.ndarray:  # the kernel's conversion, one element at a time
    out = np.empty(x.size, dtype=np.uint16)
    for i in range(x.size):
        out[i] = f32_to_bf16_bits(x[i])
    return out


def special_values(repeat: int = 3) -> torch.Tensor:
    """The special bit patterns, repeated so torch takes its vectorised path, plus random bits."""
    rng = np.random.default_rng(0)
    rand = rng.integers(0, 2**32, size=100_000, dtype=np.uint64).astype(np.uint32)
    arr = np.concatenate([np.array(SPECIAL_BITS * repeat, dtype=np.uint32), rand])
    return torch.from_numpy(arr.view(np.float32).copy())


def torch_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().to(torch.bfloat16)


def test_conversion_matches_torch_on_special_and_random_bits() -> None:
    x = special_values()
    ours = torch.from_numpy(_convert(x.numpy()).view(np.int16))
    expected = torch_bf16(x).view(torch.int16)
    finite = ~torch.isnan(x)
    assert torch.equal(ours[finite], expected[finite])
    assert (ours[~finite].view(torch.uint16).int() == BF16_NAN_BITS).all()
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":  # vectorised torch path: NaN -> 0xFFFF
        assert torch.equal(ours, expected)


def test_kernel_bf16_copy_is_torch_rounding_of_its_own_master() -> None:
    """With lr=0 the master passes through unchanged, so every special value reaches the copy."""
    x = special_values()
    n = x.numel()
    master, out = x.clone(), torch.empty(n, dtype=torch.bfloat16)
    grad = torch.full((n,), 1e-3)
    adamw_step(master, torch.zeros(n), torch.zeros(n), grad, lr=0.0, step=1, out=out)
    assert torch.isnan(master).sum() == torch.isnan(x).sum()
    assert torch.isinf(master).sum() == torch.isinf(x).sum()
    assert_bits_equal(out, torch_bf16(master), "bf16 copy")


@pytest.mark.parametrize("n", [1, 7, 4097, (1 << 20) + 3])
def test_kernel_bf16_copy_after_real_steps(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=gen) * 1e-3
    m, v, out = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        adamw_step(master, m, v, grad, lr=1e-3, step=step, out=out)
        assert_bits_equal(out, torch_bf16(master), f"bf16 copy, step {step}")


def test_bf16_grad_widening_is_exact() -> None:
    """A bf16 gradient gives the same update as its exact fp32 widening."""
    n = 10_000
    grad = (torch.randn(n) * 1e-4).to(torch.bfloat16)
    a = [torch.randn(n, generator=torch.Generator().manual_seed(3)), torch.zeros(n), torch.zeros(n)]
    b = [t.clone() for t in a]
    adamw_step(*a, grad, lr=1e-3, step=1)
    adamw_step(*b, grad.float(), lr=1e-3, step=1)
    for x, y in zip(a, b):
        assert_bits_equal(x, y)


def test_reference_copy_matches_kernel_copy_on_nan_and_inf_grads() -> None:
    n = 64
    grad = torch.zeros(n)
    grad[3], grad[9], grad[20] = float("nan"), float("inf"), -float("inf")
    outs = []
    for fn in (adamw_step, adamw_step_reference):
        out = torch.empty(n, dtype=torch.bfloat16)
        fn(torch.ones(n), torch.zeros(n), torch.zeros(n), grad, lr=1e-3, step=1, out=out)
        outs.append(out)
    assert torch.isnan(outs[0][[3, 9, 20]].float()).all()
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert_bits_equal(outs[0], outs[1], "bf16 copy with NaN")
