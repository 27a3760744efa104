"""A non-finite gradient skips the update in both schedules: every stored byte stays as it was."""

import pytest
import torch

from fuyou.engine import Engine, EngineConfig, Plan
from tests.integration.tiny_models import batches, reference_steps, tiny


def raw_state(eng):
    eng.flush()
    out = {}
    for ext in eng.store.extents:
        buf = torch.empty(ext.nbytes, dtype=torch.uint8)
        eng.store.read(ext.name, buf).result()
        out[ext.name] = buf
    return out


@pytest.mark.parametrize("clip,park", [(0.0, None), (1.0, None), (1.0, 0)])  # park 0: gradients parked on SSD
@pytest.mark.parametrize("poison_block", [1, 2])
def test_nonfinite_step_is_skipped_exactly(tmp_path, clip, park, poison_block):
    cfg, model = tiny("llama", layers=3)
    data = batches(3)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),),
        precision="fp32",
        lr=1e-3,
        cpu_memory="64MiB",
        max_grad_norm=clip,
        plan=Plan(activation_policy=("keep", "keep", "recompute", "keep", "keep"), park_ram_blocks=park),
    )
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        eng.train_step(*data[0])
        before, version = raw_state(eng), eng.store.version
        real = eng.adapter.forward

        def poisoned(b, x, ctx):
            y, ctx = real(b, x, ctx)
            return (y * float("nan"), ctx) if b == poison_block else (y, ctx)

        eng.adapter.forward = poisoned
        st = eng.train_step(*data[1])
        eng.adapter.forward = real
        assert not st["applied"] and eng.step == 1
        after = raw_state(eng)
        assert eng.store.version == version
        assert all(torch.equal(before[k], after[k]) for k in before)
        eng.train_step(*data[2])
        weights = dict(eng.master_weights())
    reference_steps(model, [data[0], data[2]], 1, 1e-3, 0.0, clip=clip)
    for k, w in weights.items():
        ref = model.state_dict()[k]
        assert (w - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-12, k


@pytest.mark.parametrize("clip", [0.0, 1.0])
@pytest.mark.parametrize("ram", [0, 3])
def test_a_step_reads_the_device_back_once(tmp_path, monkeypatch, clip, ram):
    """Loss and gradient norm stay where they are computed and are read back once per step (one
    device→host wait on a GPU), not once per micro-batch and block; RAM-tier blocks (whose writes cannot
    be rolled back) still update only after that read proved the step finite."""
    import fuyou.transfer.collectives as comm_mod  # one rank's sum_scalars is the read

    cfg, model = tiny("llama", layers=3)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = Plan(grad_accum=2, ram_weight_blocks=ram, ram_state_blocks=ram)
    ec = EngineConfig(ssd_dirs=(str(tmp_path),), precision="fp32", lr=1e-3, max_grad_norm=clip, plan=plan)
    reads, items = [], []
    real_read, real_item = comm_mod.read_scalars, torch.Tensor.item
    monkeypatch.setattr(comm_mod, "read_scalars", lambda *v: reads.append(len(v)) or real_read(*v))
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        monkeypatch.setattr(torch.Tensor, "item", lambda t: items.append(1) or real_item(t))
        results = [eng.train_step(*d) for d in batches(2)]
        monkeypatch.setattr(torch.Tensor, "item", real_item)
    assert reads == [3, 3] and items == []  # (loss, norm, balance loss) once per step; none per micro-batch or block
    assert all(r.applied and r.loss > 0 and r.grad_norm > 0 for r in results)


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_gradient_corrupted_on_its_way_to_the_host_rolls_the_step_back(tmp_path, clip):
    """The device finds the step finite, but one block's gradient arrives on the host with a NaN (a
    corrupted copy): the Adam stage's own check (the fused kernel's verdict on the new master values)
    rolls the step back — at once without clipping (the step reports not applied), when the next step
    settles it with clipping (a warning names the block) — and every stored byte stays as it was."""
    cfg, model = tiny("llama", layers=3)
    data = batches(3)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),), precision="fp32", lr=1e-3, cpu_memory="64MiB", max_grad_norm=clip, plan=Plan()
    )
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        eng.train_step(*data[0])
        before, version = raw_state(eng), eng.store.version
        real = eng.stage.gradients.offload

        def corrupted(b, grad, *args):
            buf, ev = real(b, grad, *args)
            ev.wait()
            if b == 2:
                buf.view(grad.dtype, grad.numel())[7] = float("nan")
            return buf, ev

        eng.stage.gradients.offload = corrupted
        st = eng.train_step(*data[1])
        eng.stage.gradients.offload = real
        if clip:
            assert st.applied, "with clipping the update runs after the step, during the next one's forward"
            with pytest.warns(RuntimeWarning, match=r"blocks \[2\] came out non-finite"):
                eng.flush()
        else:
            assert not st.applied
        assert eng.step == 1 and eng.store.version == version
        after = raw_state(eng)
        assert all(torch.equal(before[k], after[k]) for k in before)
