"""The host-RAM tier: RAM-resident weights/state train exactly like the all-SSD engine, without their
SSD traffic, and the store stays crash-consistent (flush writes the tier back; stale versions refused)."""

import dataclasses
import shutil

import pytest
import torch

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.engine.export import export_store
from fuyou.errors import HostMemoryError, StoreError
from fuyou.schedule.sizing import host_need
from tests.integration.test_engine_fidelity import LR, WD, assert_same
from tests.integration.tiny_models import batches, reference_steps, tiny

STEPS = 3
NBLOCKS = 4  # tiny llama, 2 layers: embed, layer.0, layer.1, head


def config(d, ram_w=0, ram_s=0, clip=0.0, cpu="256MiB", precision="fp32", **kw):
    plan = Plan(
        activation_policy=("keep", "recompute", "swap_cpu", "keep"),
        ram_weight_blocks=ram_w,
        ram_state_blocks=ram_s,
        **kw,
    )
    d.mkdir(exist_ok=True)
    return EngineConfig(
        ssd_dirs=(str(d),), precision=precision, lr=LR, weight_decay=WD, cpu_memory=cpu, max_grad_norm=clip, plan=plan,
        optimizer_state="fp32",  # bytes counted below: a split master also reads each block's weights for Adam
    )  # fmt: skip


def train(cfg, model, ec, data):
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        stats = [eng.train_step(*d) for d in data]
        weights = dict(eng.master_weights())
    return stats, weights


@pytest.mark.parametrize("ram_w,ram_s", [(2, 0), (1, 3), (NBLOCKS, NBLOCKS)])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_ram_tier_equals_ssd_engine_and_reference(tmp_path, ram_w, ram_s, clip):
    cfg, model = tiny("llama")
    data = batches(STEPS)
    ssd_stats, ssd_w = train(cfg, model, config(tmp_path / "ssd", clip=clip), data)
    ram_stats, ram_w_ = train(cfg, model, config(tmp_path / "ram", ram_w, ram_s, clip=clip), data)
    assert [s["loss"] for s in ram_stats] == [s["loss"] for s in ssd_stats]
    assert all(torch.equal(ssd_w[k], ram_w_[k]) for k in ssd_w)
    ref = reference_steps(model, data, 1, LR, WD, clip=clip)
    assert_same(model, ref, [s["loss"] for s in ram_stats], ram_w_)


def test_ssd_bytes_drop_by_exactly_the_ram_extents(tmp_path):
    cfg, model = tiny("llama")
    data = batches(STEPS)
    ram_w, ram_s = 2, 1
    ssd_stats, _ = train(cfg, model, config(tmp_path / "ssd"), data)
    ram_stats, _ = train(cfg, model, config(tmp_path / "ram", ram_w, ram_s), data)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with Engine.from_state_dict(cfg, sd, config(tmp_path / "lay", ram_w, ram_s)) as eng:
        lay = eng.layout
        # untied: no borrows; the embedding's backward reads no weights
        order = list(range(NBLOCKS - 1)) + [NBLOCKS - 1] + list(range(NBLOCKS - 2, 0, -1))
        assert eng.runner.weightless == {0}
        w_reads = sum(lay.w(b).nbytes for b in order if b < ram_w)
        state = sum(lay.s(b, c).nbytes for b in range(ram_s) for c in range(len(lay.chunks(b))))
        w_writes = sum(lay.w(b).nbytes for b in range(ram_w))
    for a, b in zip(ssd_stats, ram_stats):
        assert a["ssd_read_bytes"] - b["ssd_read_bytes"] == w_reads + state
        assert a["ssd_write_bytes"] - b["ssd_write_bytes"] == w_writes + state


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_flush_then_resume_reproduces_the_next_step(tmp_path, clip):
    cfg, model = tiny("llama_tied")
    data = batches(3)
    straight, w_straight = train(cfg, model, config(tmp_path / "a", 2, 2, clip=clip), data)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with Engine.from_state_dict(cfg, sd, config(tmp_path / "b", 2, 2, clip=clip)) as eng:
        first = [eng.train_step(*d)["loss"] for d in data[:2]]
        eng.flush()
        assert eng.store.meta["ram_tier_stale"] is False
    for d, ram in (("b", (2, 2)), ("b", (0, 0))):  # the same RAM plan, then all-SSD, from the flushed store
        ec = config(tmp_path / d, *ram, clip=clip)
        shutil.copytree(tmp_path / d, tmp_path / f"{d}{ram[0]}")
        with Engine.resume(dataclasses.replace(ec, ssd_dirs=(str(tmp_path / f"{d}{ram[0]}"),))) as eng:
            assert eng.step == 2
            last = eng.train_step(*data[2])["loss"]
            w = dict(eng.master_weights())
        assert first + [last] == [s["loss"] for s in straight]
        assert all(torch.equal(w_straight[k], w[k]) for k in w_straight)


def test_close_without_persisting_keeps_the_last_committed_version(tmp_path):
    """``close(persist=False)`` (a benchmark's): the updates in flight settle, the RAM tier is not written
    back, and the store stays at its last committed version, refused for resume as after a crash."""
    cfg, model = tiny("llama")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = config(tmp_path / "s", 2, 2)
    eng = Engine.from_state_dict(cfg, sd, ec)
    eng.train_step(*batches(1)[0])
    eng.close(persist=False)
    assert eng.store.meta["ram_tier_stale"] is True
    with pytest.raises(StoreError, match="resume from a checkpoint"):
        Engine.resume(ec)


def test_resume_and_export_of_a_stale_version_are_refused(tmp_path):
    cfg, model = tiny("llama")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = config(tmp_path / "s", 2, 2)
    eng = Engine.from_state_dict(cfg, sd, ec)
    eng.train_step(*batches(1)[0])
    assert eng.store.meta["ram_tier_stale"] is True  # per-step commit: RAM tier not written
    eng.stage.close()  # a crash: no flush, no close
    eng.act_space.close()
    eng.store.close()
    with pytest.raises(StoreError, match=r"resume from a checkpoint.*--resume auto") as e:
        Engine.resume(ec)
    assert "\n" not in str(e.value)
    with pytest.raises(StoreError, match="host RAM"):
        export_store([str(tmp_path / "s")], str(tmp_path / "out"))


def test_checkpoint_after_flush_is_consistent(tmp_path):
    from fuyou.checkpoint import restore, take

    cfg, model = tiny("llama")
    data = batches(3)
    straight, w_straight = train(cfg, model, config(tmp_path / "a", 3, 3), data)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = config(tmp_path / "b", 3, 3)
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        eng.train_step(*data[0])
        with pytest.raises(StoreError, match="flush"):
            take(eng.store, "early", {})
        eng.train_step(*data[1])
        eng.flush()
        take(eng.store, "ck", {})
        eng.train_step(*data[2])  # a later step, never flushed into the checkpoint
    restore([str(tmp_path / "b")], "ck")
    with Engine.resume(ec) as eng:
        last = eng.train_step(*data[2])["loss"]
        w = dict(eng.master_weights())
    assert last == straight[2]["loss"]
    assert all(torch.equal(w_straight[k], w[k]) for k in w_straight)


def test_too_small_budget_fails_up_front_naming_the_ram_tier(tmp_path):
    cfg, model = tiny("llama")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = config(tmp_path / "s", NBLOCKS, NBLOCKS)
    with Engine.from_state_dict(cfg, sd, config(tmp_path / "ok")) as eng:
        without = host_need(eng.layout.footprint(), eng.plan)
    with pytest.raises(HostMemoryError, match="ram-tier") as e:
        Engine.from_state_dict(cfg, sd, dataclasses.replace(ec, cpu_memory=without + 4096))
    assert "\n" not in str(e.value)
    with pytest.raises(Exception, match="5 blocks"):
        Engine.from_state_dict(cfg, sd, config(tmp_path / "x", NBLOCKS + 1, 0))


def test_planner_ram_tier_plan_is_executable_and_runs(tmp_path):
    from fuyou.models.description import describe_model
    from fuyou.planner.cost import ram_tier_bytes
    from fuyou.planner.result import Budgets, PlannerResult
    from fuyou.planner.search import Request, search
    from tests.unit.planner.helpers import profile

    cfg, model = tiny("llama")
    data = batches(2)
    shape = describe_model(cfg)
    hw = profile(ssd_read_Bps=1e8, ssd_write_Bps=1e8, adam_params_per_s=1e9, device_peak_flops=1e12)
    res = search(shape, hw, Budgets(cpu_memory=1 << 30, gpu_memory=1 << 30), Request(seq_len=16, tokens_per_step=64))
    assert res.plan.ram_weight_blocks == NBLOCKS and res.plan.ram_state_blocks > 0
    assert PlannerResult.from_json(res.to_json()) == res
    ec = EngineConfig(ssd_dirs=(str(tmp_path),), precision="bf16", lr=LR, cpu_memory=1 << 30, plan=res.plan)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        assert eng.plan.ram_weight_blocks == res.plan.ram_weight_blocks
        mem = res.prediction.memory
        assert eng.plan == res.plan  # accepted as it is
        assert host_need(eng.layout.footprint(), eng.plan) == mem.host_buffers + mem.host_ram_tiers
        assert ram_tier_bytes(shape, res.plan, res.step) == mem.host_ram_tiers
        for d in data:
            st = eng.train_step(*d)
            assert st["applied"]
        if res.plan.ram_state_blocks == NBLOCKS:
            assert st["ssd_read_bytes"] == 0 and st["ssd_write_bytes"] == 0


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_nonfinite_step_with_ram_tier_is_skipped_exactly(tmp_path, clip):
    """overlap_backward holds RAM-tier updates back until the whole step is known finite."""
    cfg, model = tiny("llama", layers=3)
    data = batches(3)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),),
        precision="fp32",
        lr=1e-3,
        cpu_memory="64MiB",
        max_grad_norm=clip,
        plan=Plan(
            activation_policy=("keep", "keep", "recompute", "keep", "keep"), ram_weight_blocks=4, ram_state_blocks=3
        ),
    )
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        eng.train_step(*data[0])
        real = eng.runner.hand_off

        def poisoned(st, b):  # only block 1's gradient is non-finite: blocks 4, 3, 2 come first
            if b == 1:
                st.grads[b][0] = float("nan")
            real(st, b)

        eng.runner.hand_off = poisoned
        assert not eng.train_step(*data[1])["applied"]
        eng.runner.hand_off = real
        eng.train_step(*data[2])
        weights = dict(eng.master_weights())
    reference_steps(model, [data[0], data[2]], 1, 1e-3, 0.0, clip=clip)
    for k, w in weights.items():
        ref = model.state_dict()[k]
        assert (w - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-12, k


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_ram_tier_reads_run_off_the_training_thread_and_are_ram_copies(tmp_path, clip, monkeypatch):
    """A RAM-tier read is a memcpy of a layer's weights (milliseconds at scale): it runs on the tier's
    copy thread, not on the thread that launches the device's work, and the timeline shows it on its
    own ``ram_copy`` resource, not as a host→device copy. The swapped activations' copies off and back
    are timed as ``d2h`` and ``h2d`` device spans."""
    import threading

    from fuyou.transfer.ram_tier import RamTier

    where: list[str] = []
    copy_out = RamTier._copy_out

    def recorded(self, *a):
        where.append(threading.current_thread().name)
        return copy_out(self, *a)

    monkeypatch.setattr(RamTier, "_copy_out", recorded)
    cfg, model = tiny("llama")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with Engine.from_state_dict(cfg, sd, config(tmp_path, 2, 1, clip=clip)) as eng:
        eng.timeline.clear()
        for d in batches(2):
            eng.train_step(*d)
        spans = list(eng.timeline.spans)
    assert where and all(n.startswith("fuyou-ram-tier") for n in where), where
    ram = [s for s in spans if s.label.startswith(("ram→host", "host→ram", "adam→host"))]
    assert ram and {s.resource for s in ram} == {"ram_copy"}
    acts = {s.resource for s in spans if s.label == "activations of block 2"}  # layer.1: swap_cpu
    assert acts == {"d2h", "h2d"}
