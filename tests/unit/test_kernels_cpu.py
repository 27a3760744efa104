"""CUDA kernels: the torch reference on CPU, and an nvcc build check of every cuda/*.cu where nvcc exists."""

import glob
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from fuyou.device.kernels import SOURCES, grad_pack, grad_pack_reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 4095, 4097, (1 << 20) + 3])
@pytest.mark.parametrize("scale", [0.5, 0.3])
def test_reference_against_an_independent_float64_oracle(dtype, n, scale):
    """The reference (what CPU runs, and what the GPU kernel's parity test compares against) checked
    by numpy in float64: each output is the input times the fp32 ``scale`` rounded to ``dtype`` (within
    half an ulp of the exact product; bf16 goes through fp32), and the sum of squares is the float64 sum of the rounded-to-fp32
    products (fp32 accumulation: rel 1e-5)."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    out = torch.empty_like(g)
    s = grad_pack(g, out, scale)  # CPU tensors: the reference
    exact = g.float().numpy().astype(np.float64) * float(np.float32(scale))  # the scale is an fp32 operand
    got = out.float().numpy().astype(np.float64)
    ulp32 = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    ulp = ulp32 * (2.0**16 if dtype == torch.bfloat16 else 1.0)
    assert np.all(np.abs(got - exact) <= ulp / 2 + ulp32 / 2 * (dtype == torch.bfloat16))  # bf16: rounded via fp32
    products = (g.float().numpy() * np.float32(scale)).astype(np.float64)
    assert s.item() == pytest.approx(float(np.sum(products * products)), rel=1e-5)


def test_reference_known_values_and_non_finite():
    out = torch.empty(3)
    s = grad_pack(torch.tensor([1.0, 2.0, -3.0]), out, 0.5)
    assert out.tolist() == [0.5, 1.0, -1.5] and s.item() == 3.5
    assert torch.isnan(grad_pack_reference(torch.tensor([1.0, float("nan")]), torch.empty(2)))
    assert torch.isinf(grad_pack_reference(torch.tensor([1.0, float("inf")]), torch.empty(2)))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("src", sorted(glob.glob(os.path.join(SOURCES, "*.cu"))), ids=os.path.basename)
def test_cuda_sources_compile_with_nvcc(tmp_path, src):
    r = subprocess.run(
        ["nvcc", "--std=c++17", "-arch=sm_90", "-ptx", src, "-o", str(tmp_path / "out.ptx")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "grad_pack_bf16" in (tmp_path / "out.ptx").read_text()
