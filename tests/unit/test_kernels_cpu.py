"""CUDA kernels: the torch reference on CPU, and an nvcc build check of every cuda/*.cu where nvcc exists."""

import glob
import os
import shutil
import subprocess

import pytest
import torch

from fuyou.device.kernels import SOURCES, grad_pack, grad_pack_reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 4095, 4097, (1 << 20) + 3])
def test_reference_semantics(dtype, n):
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    out = torch.empty_like(g)
    s = grad_pack(g, out, 0.5)  # CPU tensors: the reference
    expect = (g.float() * 0.5)
    assert torch.equal(out, expect.to(dtype))
    assert s.item() == pytest.approx((expect * expect).sum().item(), rel=1e-6)
    assert torch.isnan(grad_pack_reference(torch.tensor([1.0, float("nan")]), torch.empty(2)))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("src", sorted(glob.glob(os.path.join(SOURCES, "*.cu"))), ids=os.path.basename)
def test_cuda_sources_compile_with_nvcc(tmp_path, src):
    r = subprocess.run(["nvcc", "--std=c++17", "-arch=sm_90", "-ptx", src, "-o", str(tmp_path / "out.ptx")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "grad_pack_bf16" in (tmp_path / "out.ptx").read_text()
