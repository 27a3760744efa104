"""On a GPU the device-memory model drives ``--gpu-memory``: a step predicted to fit runs with the
allocator capped at the prediction (``set_per_process_memory_fraction``, the CUDA backend's cap), and
the figures — measured peak, prediction, the allocator's retries — are printed for bench/RESULTS.md
(skipped without a GPU)."""

import gc

import pytest
import torch

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.engine.device_admission import batch_peak
from fuyou.schedule import sizing
from tests.integration.tiny_models import batches, tiny

pytestmark = pytest.mark.gpu


def fresh() -> int:
    """Free what the allocator caches and cuBLAS's workspaces (the engine's first matmul allocates its
    own, as in a fresh process), peaks reset; the bytes earlier tests left alive (the cap is per process)."""
    gc.collect()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def segments() -> str:
    """The allocator's segments by stream and pool: count and MiB (what rounding adds to the tensors)."""
    by: dict[tuple[int, str], list[int]] = {}
    for seg in torch.cuda.memory_snapshot():
        row = by.setdefault((seg["stream"], seg["segment_type"]), [0, 0])
        row[0] += 1
        row[1] += seg["total_size"]
    return ", ".join(f"stream {st:#x} {kind}: {n} × = {b / 2**20:.0f} MiB" for (st, kind), (n, b) in sorted(by.items()))


@pytest.mark.parametrize("policy, vocab", [("keep", 1), ("recompute", 1), ("swap_cpu", 1), ("keep", 3)])
def test_a_step_predicted_to_fit_runs_under_the_predicted_cap(tmp_path, policy, vocab):
    """``vocab`` 3: the embedding and LM head split by vocabulary rows (the head's two passes, its groups
    read twice, on the copy stream while compute runs). The same steps run uncapped first: their peaks
    and the allocator's segments are printed beside the capped run's."""
    cfg, model = tiny("llama", layers=4, hidden=512)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = Plan(activation_policy=("keep",) + (policy,) * 4 + ("keep",), vocab_groups=vocab)
    big = EngineConfig(ssd_dirs=(str(tmp_path / "a"),), device="cuda", precision="bf16", plan=plan)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    base = fresh()
    with Engine.from_state_dict(cfg, sd, big) as eng:
        predicted = batch_peak(cfg, eng.layout, eng.plan, 8, 64, 1, device="cuda")
        for ids, labels in batches(3, batch=8, seq=64):
            assert eng.train_step(ids, labels).applied
        free = torch.cuda.memory_stats()
        print(
            f"\ndevice peak {policy} vocab groups {vocab}, uncapped: allocated peak "
            f"{free['allocated_bytes.all.peak'] - base} B, reserved peak {free['reserved_bytes.all.peak'] - base} B; "
            f"{segments()}"
        )
    assert predicted is not None
    base = fresh()
    cap = predicted.nbytes + base
    capped = EngineConfig(ssd_dirs=(str(tmp_path / "b"),), device="cuda", precision="bf16", plan=plan, gpu_memory=cap)
    with Engine.from_state_dict(cfg, sd, capped) as eng:
        for ids, labels in batches(3, batch=8, seq=64):
            assert eng.train_step(ids, labels).applied
        stats = torch.cuda.memory_stats()
    measured = stats["allocated_bytes.all.peak"] - base
    tensors = predicted.nbytes - sizing.ALLOCATOR_ROUNDING_BYTES  # the plan's tensors and cuBLAS's workspace
    print(
        f"\ndevice peak {policy} vocab groups {vocab}: allocated peak {measured} B beyond {base} B left by earlier "
        f"tests, predicted {tensors} B + {sizing.ALLOCATOR_ROUNDING_BYTES} B rounding ({predicted.phase}), "
        f"predicted/measured {tensors / measured:.3f}, reserved peak {stats['reserved_bytes.all.peak'] - base} B, "
        f"num_alloc_retries {stats['num_alloc_retries']}"
    )
    assert measured <= tensors
    assert stats["reserved_bytes.all.peak"] <= cap
