"""Only host buffers that cross PCIe are asked for pinned memory: weights and gradients (parked ones
too), not optimizer state, new-weight staging or the RAM tier."""

import pytest
import torch

from fuyou.device import CPUBackend
from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.schedule import sizing
from fuyou.transfer.host_pool import HostBufferPool
from tests.integration.tiny_models import tiny


class RecordingCPU(CPUBackend):
    """The real CPU backend, remembering what each host buffer was asked for (data pointer → pinned)."""

    def __init__(self, capacity: int = 2**62) -> None:
        super().__init__(capacity)
        self.pinned: dict[int, bool] = {}

    def host_empty(self, nbytes: int, pinned: bool = True) -> torch.Tensor:
        t = super().host_empty(nbytes, pinned)
        self.pinned[t.data_ptr()] = pinned
        return t


CROSSING = (sizing.WEIGHTS, sizing.GRADS, sizing.park_class(0), sizing.park_class(7))
HOST_ONLY = (sizing.STATE, sizing.NEW_WEIGHTS, sizing.RAM_WEIGHTS, sizing.RAM_STATE)


def test_the_classes_that_cross_pcie():
    assert all(sizing.crosses_pcie(c) for c in CROSSING)
    assert not any(sizing.crosses_pcie(c) for c in HOST_ONLY)
    assert sizing.crosses_pcie("some new class"), "a class not known to stay on the host is pinned"


def test_pool_asks_pinned_memory_exactly_for_the_classes_that_cross_pcie():
    b = RecordingCPU()
    pool = HostBufferPool(b, budget=1 << 24)
    for i, kind in enumerate(CROSSING + HOST_ONLY):
        pool.reserve(kind, 4096 * (i + 1) + 1, 2)
    for kind in CROSSING + HOST_ONLY:
        bufs = [pool.acquire(kind), pool.acquire(kind)]
        assert [b.pinned[buf.data.data_ptr()] for buf in bufs] == [sizing.crosses_pcie(kind)] * 2, kind
    assert pool.pinned == sum(4096 * (i + 2) * 2 for i in range(len(CROSSING)))


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_engine_pins_weights_and_gradients_only(tmp_path, monkeypatch, clip):
    """A whole engine on a recording backend: every host buffer it reserves — streaming classes, parked
    gradients (clipping), the RAM tier — is asked pinned exactly when its class crosses PCIe."""
    import fuyou.engine.engine as engine_mod

    backend = RecordingCPU()
    monkeypatch.setattr(engine_mod, "get_backend", lambda kind, capacity=None: backend)
    cfg, model = tiny("llama", layers=3)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = Plan(prefetch_depth=1, ram_weight_blocks=2, ram_state_blocks=1)
    ec = EngineConfig(ssd_dirs=(str(tmp_path),), cpu_memory="64MiB", max_grad_norm=clip, plan=plan)
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        seen: dict[str, set[bool]] = {}
        for kind, bufs in eng.pool._free.items():
            seen[kind] = {backend.pinned[buf.data.data_ptr()] for buf in bufs}
        for buf in eng.tier._held:
            seen[buf.kind] = {backend.pinned[buf.data.data_ptr()]}
    assert {sizing.RAM_WEIGHTS, sizing.RAM_STATE, sizing.STATE, sizing.NEW_WEIGHTS} <= set(seen)
    assert clip == 0 or any(k.startswith("park/") for k in seen), "clipping parks gradients in RAM"
    assert seen == {k: {sizing.crosses_pcie(k)} for k in seen}
    assert len(backend.pinned) == sum(c for _, c in eng.pool._sizes.values()), "every host buffer went through the pool"
