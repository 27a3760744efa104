"""The engine's fidelity suite on CUDA (skipped without a GPU): same model as plain PyTorch on the same GPU.

A CPU reference is no yardstick here: where a gradient is rounding noise (2-token batches: most of a
query projection's), Adam turns CPU-vs-GPU rounding into differences of the learning rate's size (the
first H100 run, 2026-11-26: 1.5e-3 on weights of 0.1 with identical losses)."""

import pytest
import torch

from fuyou.engine import Engine, EngineConfig, Plan
from tests.gpu.test_fidelity_fp32_same_gpu import reference_on_gpu
from tests.integration.test_engine_fidelity import (
    LR,
    WD,
    assert_bf16_close,
    assert_same,
    reference_bf16_steps,
    run_fuyou,
)
from tests.integration.tiny_models import batches, tiny

pytestmark = pytest.mark.gpu


def run(cfg, model, tmp_path, data, policy, K=1, clip=0.0, hidden_bound=False):
    n = cfg.num_hidden_layers + 2
    plan = Plan(grad_accum=K, prefetch_depth=2, activation_policy=("keep",) + (policy,) * (n - 2) + ("keep",))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),),
        device="cuda",
        precision="fp32",
        lr=LR,
        weight_decay=WD,
        cpu_memory="512MiB",
        max_grad_norm=clip,
        plan=plan,
    )
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        losses = [eng.train_step(ids, labels)["loss"] for ids, labels in data]
        return losses, dict(eng.master_weights())


@pytest.mark.parametrize("policy", ["keep", "swap_cpu", "swap_ssd", "recompute", "recompute_cpu"])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_cuda_matches_pytorch(tmp_path, policy, clip):
    cfg, model = tiny("llama_tied", layers=3)
    data = batches(4)
    losses, weights = run(cfg, model, tmp_path, data, policy, K=2, clip=clip)
    assert_same(model, reference_on_gpu(model, data, K=2, clip=clip), losses, weights)


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_cuda_bf16_matches_the_plain_bf16_recipe(tmp_path, policy):
    """bf16 compute weights and fp32 master on CUDA vs the same recipe written plainly on the same GPU."""
    cfg, model = tiny("llama")
    data = batches(3)
    losses, weights = run_fuyou(cfg, model, tmp_path, data, policy=policy, precision="bf16", device="cuda")
    assert_bf16_close(losses, weights, *reference_bf16_steps(model, data, device="cuda"))


def test_race_bait_wide_low_flop_layers(tmp_path):
    """Wide layers, 2 tokens: copies dominate, so a missing stream wait shows up as a wrong result."""
    cfg, model = tiny("llama", layers=2, hidden=1024)
    data = batches(3, batch=1, seq=2)
    losses, weights = run(cfg, model, tmp_path, data, "keep")
    assert_same(model, reference_on_gpu(model, data), losses, weights)


def test_budget_held_on_real_allocator(tmp_path):
    """The cap holds for everything the allocator reserves (it is torch's per-process memory fraction),
    so it leaves room for cuBLAS's workspaces (64 MiB on Hopper) and 20 MiB segments of ~5 MB blocks."""
    cfg, model = tiny("llama", layers=4, hidden=512)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cap = 128 << 20
    ec = EngineConfig(ssd_dirs=(str(tmp_path),), device="cuda", gpu_memory=cap, cpu_memory="512MiB")
    torch.cuda.reset_peak_memory_stats()
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        for ids, labels in batches(2):
            eng.train_step(ids, labels)
        m = eng.backend.memory()
        assert m.peak <= m.capacity == cap and m.reserved <= cap
    assert torch.cuda.max_memory_allocated() <= torch.cuda.max_memory_reserved() <= cap
