"""The update policies (``fuyou.engine.updates``), one test per policy on a real tiny engine: which one a
run gets, what it leaves pending between steps, what the loader's gate waits for, what commits when, and
``OneRank``, the collectives of one process."""

from __future__ import annotations

import math

import pytest
import torch

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.engine.updates import ClipOverlapNextForward, LoraAdapters, UpdateInBackward, clip_scale
from fuyou.models.lora import LoraSettings
from fuyou.transfer.collectives import OneRank
from tests.integration.tiny_models import batches, tiny


def engine(tmp_path, **kw) -> Engine:
    cfg, model = tiny("llama", layers=2)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(ssd_dirs=(str(tmp_path),), precision="fp32", lr=1e-3, **kw)
    return Engine.from_state_dict(cfg, sd, ec)


def test_clip_scale():
    assert clip_scale(4.0, 0.0) == 1.0  # no clipping
    assert clip_scale(4.0, 10.0) == 1.0  # norm 2 under the threshold
    assert clip_scale(4.0, 1.0) == pytest.approx(0.5, rel=1e-6)


def test_update_in_backward_leaves_nothing_pending(tmp_path):
    """No clipping: every block updated and committed within its step; the gate never waits."""
    with engine(tmp_path, max_grad_norm=0.0, plan=Plan(ram_weight_blocks=2, ram_state_blocks=2)) as eng:
        pol = eng.updates
        assert type(pol) is UpdateInBackward and pol.last == 0 and list(pol.held) == [1]
        v0 = eng.store.version
        for ids, labels in batches(2):
            assert eng.train_step(ids, labels).applied
        assert eng.step == 2 and eng.store.version == v0 + 2  # committed at each step's end
        assert all(pol.gate(b).done() for b in range(len(eng.layout.blocks)))
        assert pol.settle()


def test_clipping_submits_updates_that_overlap_the_next_step(tmp_path):
    """Clipping: after a step every block's update is pending, the gate hands out its future, and the
    store commits the step only when ``settle`` (the next step's end, or a flush) has waited for them."""
    with engine(tmp_path, max_grad_norm=1.0) as eng:
        pol = eng.updates
        assert type(pol) is ClipOverlapNextForward
        v0 = eng.store.version
        ids, labels = batches(1)[0]
        assert eng.train_step(ids, labels).applied and eng.step == 1
        n = len(eng.layout.blocks)
        assert sorted(pol.pending) == list(range(n)) and eng.store.version == v0
        assert all(pol.gate(b) is pol.pending[b] for b in range(n))
        assert pol.settle() and not pol.pending and eng.store.version == v0 + 1
        assert all(pol.gate(b).done() for b in range(n))


def test_lora_adapters_step_the_adapters_and_never_the_base(tmp_path):
    """LoRA: no block hands a gradient off; finish steps the adapters; the base's store is not written."""
    with engine(tmp_path, max_grad_norm=1.0, lora=LoraSettings(rank=4, alpha=8)) as eng:
        pol = eng.updates
        assert type(pol) is LoraAdapters and not any(
            eng.layout.gets_gradients(b) for b in range(len(eng.layout.blocks))
        )
        before = {k: v.detach().clone() for k, v in eng.lora.params.items()}
        written = eng.store.version
        ids, labels = batches(1)[0]
        assert eng.train_step(ids, labels).applied and eng.step == 1
        assert any(not torch.equal(before[k], v) for k, v in eng.lora.params.items())
        assert eng.store.version == written
        with pytest.raises(NotImplementedError):
            pol.hand_off(None, 0, None, None)  # type: ignore[arg-type]


def test_one_rank_is_n_equals_1(tmp_path):
    """One process: the collectives are ``OneRank``, whose sums are the values and whose scatter leaves
    the gradient whole; the engine runs the same path as with several ranks."""
    with engine(tmp_path) as eng:
        comm = eng.comm
        assert isinstance(comm, OneRank) and (comm.rank, comm.world) == (0, 1) and not eng.loader.sharded
    g = torch.arange(4.0)
    shard, after, sq = comm.scatter_gradient(g, 1.0, "block")
    assert shard is g and after is None and float(sq) == 1.0 + 14.0
    assert comm.sum_scalars(torch.tensor(2.0), 3.0) == [2.0, 3.0]
    assert comm.sum_int(5) == comm.min_int(5) == 5 and comm.any(True) and not comm.any(False)
    assert comm.gather_to_root(g) is g and comm.gather_everywhere(g) is g
    t = torch.ones(3)
    comm.sum_on_device(t, "x")
    assert torch.equal(t, torch.ones(3)) and not math.isnan(float(sq))
