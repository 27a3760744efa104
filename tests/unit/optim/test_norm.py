"""The gradient sum-of-squares kernel (numba) against the float64 oracle."""

import math

import pytest
import torch

from fuyou.optim.norm import CHUNK, sum_squares, sum_squares_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, CHUNK - 1, CHUNK, 3 * CHUNK + 5, 1_000_003])
def test_matches_the_float64_oracle(dtype, n):
    g = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    ref = sum_squares_reference(g)
    assert sum_squares(g) == pytest.approx(ref, rel=1e-12)


def test_more_accurate_than_an_fp32_accumulation():
    g = torch.ones(50_000_000, dtype=torch.bfloat16)
    assert sum_squares(g) == 50_000_000.0  # fp32 running sums stall at 2**24


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_gradients_give_a_non_finite_sum(bad, dtype):
    g = torch.ones(3 * CHUNK, dtype=dtype)
    g[2 * CHUNK + 17] = bad
    assert not math.isfinite(sum_squares(g))


def test_huge_finite_values_do_not_overflow():
    g = torch.full((10,), 1e30, dtype=torch.float32)  # 1e60 overflows fp32, not float64
    assert sum_squares(g) == pytest.approx(1e61)


def test_empty_and_strided_inputs():
    assert sum_squares(torch.empty(0)) == 0.0
    g = torch.randn(100, 3)[:, 0]  # not contiguous: torch path
    assert sum_squares(g) == pytest.approx(sum_squares_reference(g), rel=1e-5)
