"""cuda/grad_pack.cu against its torch reference on a real GPU (skipped without one or without cupy)."""

import pytest
import torch

from fuyou.device.kernels import cupy_usable, grad_pack, grad_pack_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 31, 4097, (1 << 22) + 3])
def test_grad_pack_parity(dtype, n):
    if not cupy_usable():
        pytest.skip("cupy not installed")
    g = torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)).to(dtype)
    out, ref = torch.empty_like(g), torch.empty_like(g)
    s = grad_pack(g, out, 0.25)
    r = grad_pack_reference(g, ref, 0.25)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert s.item() == pytest.approx(r.item(), rel=1e-5)


def test_nonfinite_propagates():
    if not cupy_usable():
        pytest.skip("cupy not installed")
    g = torch.ones(10_000, device="cuda", dtype=torch.bfloat16)
    g[1234] = float("inf")
    assert not torch.isfinite(grad_pack(g, torch.empty_like(g), 1.0)).item()
