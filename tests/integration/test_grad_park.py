"""Exact clipping within any host budget: gradients parked on SSD (``Plan.park_ram_blocks``)."""

import dataclasses

import pytest
import torch

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.errors import HostMemoryError
from fuyou.models.adapters import make_adapter
from fuyou.models.store_layout import ModelLayout
from fuyou.schedule.sizing import fit_host, host_need
from tests.integration.tiny_models import batches, tiny

LR, CLIP = 1e-3, 0.05  # a small clip threshold: the coefficient is < 1 on every step


def train(tmp_path, name, plan, cpu="256MiB", steps=4, family="llama_tied"):
    cfg, model = tiny(family, layers=3)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    d = tmp_path / name
    d.mkdir()
    ec = EngineConfig(
        ssd_dirs=(str(d),), precision="fp32", lr=LR, cpu_memory=cpu, max_grad_norm=CLIP, plan=plan,
        optimizer_state="fp32",  # the budgets below are sized on an fp32-state layout
    )  # fmt: skip
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        results = [eng.train_step(ids, labels) for ids, labels in batches(steps)]
        out = [
            (st["loss"], st["grad_norm"], st["applied"], st["ssd_write_bytes"], st["ssd_read_bytes"]) for st in results
        ]
        executed = eng.plan
        weights = {k: v.clone() for k, v in eng.master_weights()}
        peak = eng.pool.peak
    return out, weights, executed, peak


@pytest.mark.parametrize("ram_blocks", [0, 2])
def test_parking_on_ssd_is_bit_identical_to_parking_in_ram(tmp_path, ram_blocks):
    ram, w_ram, _, _ = train(tmp_path, "ram", Plan())
    ssd, w_ssd, plan, _ = train(tmp_path, "ssd", Plan(park_ram_blocks=ram_blocks))
    assert plan.park_ram_blocks == ram_blocks and plan.schedule == "overlap_next_forward"
    assert [r[:3] for r in ram] == [s[:3] for s in ssd]
    assert all(torch.equal(w_ram[k], w_ssd[k]) for k in w_ram)
    # the parked gradients went through the SSD: more bytes written and read than parking in RAM
    assert sum(s[3] for s in ssd[1:]) > sum(r[3] for r in ram[1:])
    assert sum(s[4] for s in ssd[1:]) > sum(r[4] for r in ram[1:])


def _layout_and_budget(family="llama_tied"):
    cfg, _ = tiny(family, layers=3)
    ad = make_adapter(cfg)
    layout = ModelLayout(tuple(ad.blocks), torch.float32, state_chunk=1 << 20)
    clip = Plan(schedule="overlap_next_forward", prefetch_depth=1, state_chunk=1 << 20)
    all_ssd = host_need(layout.footprint(), dataclasses.replace(clip, park_ram_blocks=0))
    all_ram = host_need(layout.footprint(), clip)
    return layout, clip, all_ssd, all_ram


def test_rules_park_on_ssd_before_refusing(tmp_path):
    """A budget below what parking every gradient in RAM needs: the rules move parks to SSD and the
    run trains, inside the budget, with exact clipping."""
    layout, clip, all_ssd, all_ram = _layout_and_budget()
    assert all_ram > all_ssd
    budget = (all_ssd + all_ram) // 2
    fitted = fit_host(layout.footprint(), clip, budget, fixed_chunk=True)
    assert fitted.park_ram_blocks is not None and 0 < fitted.park_ram_blocks < len(layout.blocks)
    assert host_need(layout.footprint(), fitted) <= budget
    ref, w_ref, _, _ = train(tmp_path, "ref", Plan(prefetch_depth=1))
    out, w, plan, peak = train(tmp_path, "tight", Plan(prefetch_depth=1), cpu=budget)
    assert plan.park_ram_blocks is not None and plan.park_ram_blocks < len(layout.blocks)
    assert peak <= budget
    assert [r[:3] for r in ref] == [o[:3] for o in out]
    assert all(torch.equal(w_ref[k], w[k]) for k in w_ref)


def test_budget_error_groups_classes_and_names_every_way_out(tmp_path):
    layout, clip, all_ssd, _ = _layout_and_budget()
    cfg, model = tiny("llama_tied", layers=3)
    sd = model.state_dict()
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),),
        precision="fp32",
        cpu_memory=all_ssd // 2,
        max_grad_norm=1.0,
        plan=Plan(prefetch_depth=1),
    )
    with pytest.raises(HostMemoryError) as e:
        Engine.from_state_dict(cfg, sd, ec)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.count("park/") == 0  # grouped, not one entry per block
    for way in ("--cpu-memory", "prefetch", "SSD", "--max-grad-norm 0"):
        assert way in msg, (way, msg)
