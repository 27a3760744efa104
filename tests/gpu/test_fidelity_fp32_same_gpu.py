"""Fuyou fp32 on CUDA equals plain PyTorch + AdamW on the same GPU (TF32 off, see conftest.py), at the
CPU fidelity tests' tolerance, under the activation policies those tests use (skipped without a GPU).

Both sides run the same kernels on the same device, so the CPU tests' 1e-5 holds (``test_engine_cuda.py``
uses this reference too: against a CPU one, Adam magnifies GPU rounding where gradients are noise)."""

import pytest
import torch

from tests.integration.test_engine_fidelity import LR, STEPS, WD, assert_same, run_fuyou
from tests.integration.tiny_models import batches, reference_steps, tiny

pytestmark = pytest.mark.gpu

POLICIES = ["keep", "swap_cpu", "swap_ssd", "recompute", "recompute_cpu"]


def reference_on_gpu(model, data, K: int = 1, clip: float = 0.0) -> list[float]:
    """``reference_steps`` with the model and the batches on the GPU; the model comes back to the CPU
    (its state dict is what ``assert_same`` compares with)."""
    model.cuda()
    try:
        return reference_steps(model, [(i.cuda(), lab.cuda()) for i, lab in data], K, LR, WD, clip=clip)
    finally:
        model.cpu()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("policy", POLICIES)
def test_fp32_on_cuda_equals_plain_pytorch_on_the_same_gpu(tmp_path, family, policy):
    assert getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee") == "ieee"
    cfg, model = tiny(family)
    data = batches(STEPS)
    losses, weights = run_fuyou(cfg, model, tmp_path, data, policy=policy, device="cuda")
    assert_same(model, reference_on_gpu(model, data), losses, weights)


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_accumulation_and_clipping_on_the_same_gpu(tmp_path, policy):
    """Two micro-batches a step and global-norm clipping (the overlap_next_forward schedule), tied embeddings."""
    cfg, model = tiny("llama_tied", layers=3)
    data = batches(STEPS)
    losses, weights = run_fuyou(cfg, model, tmp_path, data, policy=policy, K=2, clip=0.5, device="cuda")
    assert_same(model, reference_on_gpu(model, data, K=2, clip=0.5), losses, weights)
