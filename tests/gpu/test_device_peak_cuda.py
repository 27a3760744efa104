"""On a GPU the device-memory model drives ``--gpu-memory``: a step predicted to fit runs with the
allocator capped at the prediction (``set_per_process_memory_fraction``, the CUDA backend's cap), and
the figures — measured peak, prediction, the allocator's retries — are printed for bench/RESULTS.md
(skipped without a GPU)."""

import pytest
import torch

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.engine.device_admission import batch_peak
from tests.integration.tiny_models import batches, tiny

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("policy, vocab", [("keep", 1), ("recompute", 1), ("swap_cpu", 1), ("keep", 3)])
def test_a_step_predicted_to_fit_runs_under_the_predicted_cap(tmp_path, policy, vocab):
    """``vocab`` 3: the embedding and LM head split by vocabulary rows (the head's two passes, its groups
    read twice, on the copy stream while compute runs)."""
    cfg, model = tiny("llama", layers=4, hidden=512)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = Plan(activation_policy=("keep",) + (policy,) * 4 + ("keep",), vocab_groups=vocab)
    big = EngineConfig(ssd_dirs=(str(tmp_path / "a"),), device="cuda", precision="bf16", plan=plan)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with Engine.from_state_dict(cfg, sd, big) as eng:
        predicted = batch_peak(cfg, eng.layout, eng.plan, 8, 64, 1, device="cuda")
    assert predicted is not None
    capped = EngineConfig(
        ssd_dirs=(str(tmp_path / "b"),), device="cuda", precision="bf16", plan=plan, gpu_memory=predicted.nbytes
    )
    torch.cuda.reset_peak_memory_stats()
    with Engine.from_state_dict(cfg, sd, capped) as eng:
        for ids, labels in batches(3, batch=8, seq=64):
            assert eng.train_step(ids, labels).applied
        stats = torch.cuda.memory_stats()
    measured = stats["allocated_bytes.all.peak"]
    print(
        f"\ndevice peak {policy} vocab groups {vocab}: measured {measured} B, predicted {predicted.nbytes} B ({predicted.phase}), "
        f"predicted/measured {predicted.nbytes / measured:.3f}, reserved peak {stats['reserved_bytes.all.peak']} B, "
        f"num_alloc_retries {stats['num_alloc_retries']}"
    )
    assert measured <= predicted.nbytes
