"""``--gpu-memory`` is a real cap on a GPU, host buffers are pinned only where they cross PCIe, and
host waits sleep (skipped without a GPU)."""

import time

import pytest
import torch

from fuyou.device import get_backend
from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.errors import DeviceMemoryError
from fuyou.schedule import sizing
from tests.integration.tiny_models import VOCAB, batches, tiny

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def capped_bytes() -> int:
    """What torch's allocator may reserve now: its per-process fraction of the device's memory."""
    return int(torch.cuda.get_per_process_memory_fraction() * torch.cuda.mem_get_info()[1])


def test_capacity_becomes_the_per_process_memory_fraction():
    get_backend("cuda", capacity=1 << 30)
    assert abs(capped_bytes() - (1 << 30)) <= MiB
    get_backend("cuda")  # the whole device: a later backend undoes an earlier cap
    assert torch.cuda.get_per_process_memory_fraction() == 1.0


def test_torchs_own_allocations_are_capped():
    """Memory Fuyou never sees (activations, logits, workspaces: plain torch allocations) stays under
    the cap: past it torch raises, the allocator having reserved no more than the cap."""
    get_backend("cuda", capacity=256 * MiB)
    ok = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    del ok
    assert torch.cuda.max_memory_reserved() <= 256 * MiB


def test_reserved_is_counted():
    b = get_backend("cuda", capacity=1 << 30)
    before = torch.cuda.memory_allocated()  # earlier tests' cuBLAS workspaces stay allocated
    t = b.device_empty((32 * MiB,), torch.uint8, "cached block")
    del t
    m = b.memory()
    assert m.allocated == before == torch.cuda.memory_allocated()
    assert m.reserved == torch.cuda.memory_reserved() and m.reserved - m.allocated >= 32 * MiB
    assert m.capacity == 1 << 30


def engine_config(tmp_path, gpu_memory, **kw) -> EngineConfig:
    return EngineConfig(ssd_dirs=(str(tmp_path),), device="cuda", gpu_memory=gpu_memory, cpu_memory="512MiB", **kw)


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_cap_below_the_model_refuses_with_the_one_line_error(tmp_path):
    cfg, model = tiny("llama", layers=2, hidden=512)
    with pytest.raises(DeviceMemoryError) as e:
        Engine.from_state_dict(cfg, state(model), engine_config(tmp_path, 4 * MiB))
    msg = str(e.value)
    assert "\n" not in msg and "largest block needs" in msg and "cuBLAS workspace" in msg and "--gpu-memory" in msg


def test_activations_past_the_cap_are_the_one_line_error_and_the_cap_holds(tmp_path):
    """The cap admits the model (its floor plus a little) but not the step's kept activations (4096
    tokens × 512 wide, every block ``keep``): the step fails with one line, and torch never reserved
    more than the cap meanwhile."""
    cfg, model = tiny("llama", layers=4, hidden=512)
    numel = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    cap = 4 * numel + sizing.library_bytes("cuda") + 4 * MiB  # bf16 weights + grads of a layer, workspace, rounding
    ids = torch.randint(0, VOCAB, (64, 64))
    plan = Plan(prefetch_depth=1, activation_policy=("keep",) * (4 + 2))
    with Engine.from_state_dict(cfg, state(model), engine_config(tmp_path, cap, plan=plan)) as eng:
        with pytest.raises(DeviceMemoryError) as e:
            eng.train_step(ids, ids)
        assert "\n" not in str(e.value) and "--gpu-memory" in str(e.value)
        assert torch.cuda.max_memory_reserved() <= cap


def test_host_empty_pins_only_on_request():
    b = get_backend("cuda")
    pinned, pageable = b.host_empty((1 << 20) + 3, pinned=True), b.host_empty((1 << 20) + 3, pinned=False)
    assert pinned.is_pinned() and not pageable.is_pinned()
    assert pageable.numel() == (1 << 20) + 3 and pageable.data_ptr() % 4096 == 0


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_only_buffers_that_cross_pcie_are_pinned(tmp_path, clip):
    """Weights and gradients (parked ones too) are page-locked; optimizer state, new-weight staging and
    the RAM tier are pageable (cudart's pointer attributes, through ``is_pinned``)."""
    cfg, model = tiny("llama", layers=3, hidden=256)
    plan = Plan(prefetch_depth=1, ram_weight_blocks=2, ram_state_blocks=1)
    with Engine.from_state_dict(cfg, state(model), engine_config(tmp_path, None, max_grad_norm=clip, plan=plan)) as eng:
        bufs = [buf for free in eng.pool._free.values() for buf in free] + list(eng.tier._held)
        pinned = {buf.kind: buf.data.is_pinned() for buf in bufs}
        assert {sizing.WEIGHTS, sizing.GRADS, sizing.STATE, sizing.NEW_WEIGHTS, sizing.RAM_WEIGHTS} <= set(pinned)
        assert pinned == {k: sizing.crosses_pcie(k) for k in pinned}
        assert eng.pool.pinned < eng.pool.reserved
        for ids, labels in batches(2):  # pageable state and RAM tier still train
            eng.train_step(ids, labels)


def test_a_host_wait_sleeps_instead_of_spinning():
    """``Event.wait()`` on a long kernel: the waiting thread uses a fraction of the wall time in CPU
    (a spinning ``cudaEventSynchronize`` would use all of it, stealing a core from the CPU Adam)."""
    b = get_backend("cuda")
    torch.cuda._sleep(10_000_000)  # warm up (context, module load)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s at ~2 GHz
    ev = b.record()
    t0, c0 = time.perf_counter(), time.thread_time()
    ev.wait()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert ev.query() and wall > 0.2
    assert cpu < 0.5 * wall, f"the host wait spun: {cpu:.2f} s CPU in {wall:.2f} s"
