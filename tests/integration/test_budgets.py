"""Budgets: the engine trains inside a small device capacity and host budget, or refuses up front."""

import pytest
import torch

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.errors import DeviceMemoryError, HostMemoryError
from tests.integration.tiny_models import batches, tiny


def state_bytes(model):
    return 12 * sum(p.numel() for p in model.parameters())  # fp32 master + m + v


def test_trains_far_below_both_budgets(tmp_path):
    cfg, model = tiny("llama", layers=32)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights_bytes = 2 * sum(p.numel() for p in model.parameters())
    host = state_bytes(model) // 10
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),), cpu_memory=host, gpu_memory=weights_bytes // 5, plan=Plan(prefetch_depth=1)
    )
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        assert eng.pool.reserved <= host
        # every tensor compute allocates counts: the 32 layers' kept inputs and one layer's working set
        losses = [eng.train_step(ids, labels)["loss"] for ids, labels in batches(3, batch=2)]
        mem = eng.backend.memory()
        assert mem.peak <= mem.capacity <= weights_bytes / 5
    assert all(torch.isfinite(torch.tensor(losses)))


def test_host_budget_too_small_fails_up_front(tmp_path):
    cfg, model = tiny("llama", layers=4)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(ssd_dirs=(str(tmp_path),), cpu_memory="100KiB")
    with pytest.raises(HostMemoryError, match="host budget is 100.0 KiB.*--cpu-memory"):
        Engine.from_state_dict(cfg, sd, ec)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_device_budget_too_small_fails_up_front(tmp_path):
    cfg, model = tiny("llama", layers=4)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(ssd_dirs=(str(tmp_path),), gpu_memory="8KiB")
    with pytest.raises(DeviceMemoryError, match="largest block needs.*8.0 KiB.*--gpu-memory"):
        Engine.from_state_dict(cfg, sd, ec)


def test_the_devices_own_out_of_memory_is_the_one_line_budget_error(tmp_path, monkeypatch):
    """Memory Fuyou's budget does not count (activations, logits, library workspaces) can still run the
    device out: torch's OutOfMemoryError becomes DeviceMemoryError, one line, naming the ways out; the
    last committed version stays readable."""
    cfg, model = tiny("llama", layers=2)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with Engine.from_state_dict(cfg, sd, EngineConfig(ssd_dirs=(str(tmp_path),), precision="fp32")) as eng:
        real = eng.adapter.forward

        def oom(b, x, ctx):
            if b == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.6 GiB total)")
            return real(b, x, ctx)

        monkeypatch.setattr(eng.adapter, "forward", oom)
        with pytest.raises(DeviceMemoryError, match="ran out of memory during a step.*--gpu-memory") as e:
            eng.train_step(*batches(1)[0])
        assert (
            "\n" not in str(e.value)
            and "asking for 2.00 GiB with" in str(e.value)
            and "held by the allocator" in str(e.value)
        )
        monkeypatch.setattr(eng.adapter, "forward", real)
        assert eng.train_step(*batches(1)[0]).applied  # the engine still trains after the refused step
