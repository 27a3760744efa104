"""The Adam update's verdict on its result: finite, or not (a non-finite gradient reached it).

The fused kernel checks the new master values block by block as it writes them (integer tests on the
exponent bits, no extra pass over memory); the reference checks with ``torch.isfinite``. Both must say
the same for NaN and ±inf anywhere — first, last, inside a task, at a task or block seam — in fp32 and
bf16 gradients, with and without the bf16 copy out, and the update itself stays bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from fuyou.optim import adamw_step, adamw_step_reference

N = 3 * 4096 + 77  # several tasks of chunk 4096, a ragged tail
POSITIONS = [0, 127, 128, 4095, 4096, N - 1]
CASES = [(None, 0)] + [(bad, pos) for bad in (float("nan"), float("inf"), float("-inf")) for pos in POSITIONS]
"""(the non-finite value, where), and the all-finite case."""


def _state(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g), torch.randn(N, generator=g).abs() * 1e-3, torch.rand(N, generator=g) * 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad, pos", CASES)
@pytest.mark.parametrize("with_out", [False, True])
def test_kernel_and_reference_agree_on_finiteness(dtype, bad, pos, with_out):
    grad = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(dtype)
    if bad is not None:
        grad[pos] = bad
    results = []
    for step_fn, kw in ((adamw_step, {"chunk": 4096}), (adamw_step_reference, {})):
        master, m, v = _state(0)
        out = torch.empty(N, dtype=torch.bfloat16) if with_out else None
        finite = step_fn(master, m, v, grad, lr=1e-3, step=3, out=out, **kw)
        results.append((finite, master))
    (k_finite, k_master), (r_finite, r_master) = results
    assert k_finite is r_finite is (bad is None)
    assert torch.isfinite(k_master).all().item() is k_finite
    if bad is None:
        assert torch.equal(k_master.view(torch.int32), r_master.view(torch.int32))


def test_an_empty_update_is_finite():
    e = torch.empty(0)
    assert adamw_step(e, e.clone(), e.clone(), e.clone(), lr=1e-3, step=1) is True
