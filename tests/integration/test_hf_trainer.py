"""FuyouTrainer trains the same model as plain transformers.Trainer (fp32), and refuses what it cannot do."""

import copy

import pytest
import torch
from transformers import Trainer, TrainingArguments

from fuyou import FuyouTrainer, FuyouTrainingArguments
from fuyou.engine.lora import LoraState
from fuyou.errors import ConfigError
from tests.integration.tiny_models import VOCAB, tiny


def dataset(n=24, seq=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        labels = ids.clone()
        labels[: i % 5] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


COMMON = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    max_steps=6,
    learning_rate=3e-3,
    warmup_steps=2,
    lr_scheduler_type="cosine",
    max_grad_norm=0.5,
    weight_decay=0.05,
    seed=7,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    save_strategy="no",
    dataloader_num_workers=0,
)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def plain_and_fuyou(tmp_path, ref_model, model, data, common=COMMON, **fuyou):
    """transformers.Trainer on ``ref_model`` and FuyouTrainer on ``model`` (same data and settings;
    ``fuyou``: FuyouTrainingArguments' own), both trained; returns (the plain trainer, the Fuyou one)."""
    ref = Trainer(
        model=ref_model,
        args=TrainingArguments(output_dir=str(tmp_path / "ref"), optim="adamw_torch", **common),
        train_dataset=data,
    )
    ref.train()
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    args = FuyouTrainingArguments(
        output_dir=str(tmp_path / "fy"), optim="adamw_torch", ssd_dirs=[str(ssd)], cpu_memory="64MiB",
        **common, **fuyou,
    )  # fmt: skip
    fy = FuyouTrainer(model=model, args=args, train_dataset=data)
    fy.train()
    return ref, fy


def test_same_losses_and_weights_as_plain_trainer(tmp_path):
    _, model = tiny("llama_tied", layers=2)
    ref_model = copy.deepcopy(model)
    data = dataset()
    ref, fy = plain_and_fuyou(tmp_path, ref_model, model, data)
    assert len(losses(fy)) == 6 and fy.engine.layout.optimizer_state.name == "split"  # optimizer_state auto
    assert losses(fy) == pytest.approx(losses(ref), rel=1e-5)
    ref_sd = ref_model.state_dict()
    for k, v in fy.model.state_dict().items():
        assert (v - ref_sd[k]).abs().max().item() <= 1e-5 * ref_sd[k].abs().max().item() + 1e-12, k
    fy.save_model(str(tmp_path / "saved"))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(loaded.state_dict()["model.norm.weight"], fy.model.state_dict()["model.norm.weight"])
    assert fy.evaluate(eval_dataset=data[:4])["eval_loss"] > 0


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(optim="sgd"), "optim='sgd' is not supported"),
        (dict(fp16=True), "fp16 is not supported"),
        (dict(gradient_checkpointing=True), "gradient_checkpointing"),
        (dict(optimizer_state="int4"), "optimizer_state='int4' is not one of auto, fp32, split, bf16"),
    ],
)
def test_unsupported_settings_fail_at_construction(tmp_path, bad, match):
    _, model = tiny("llama")
    kw = {**COMMON, "optim": "adamw_torch", **bad}
    try:
        args = FuyouTrainingArguments(output_dir=str(tmp_path), ssd_dirs=[str(tmp_path)], **kw)
    except ValueError as e:  # transformers itself may reject the combination first (fp16 on CPU)
        assert "fp16" in str(e) or "bf16" in str(e)
        return
    with pytest.raises(ConfigError, match=match):
        FuyouTrainer(model=model, args=args, train_dataset=dataset())


def test_plain_training_arguments_and_missing_ssd_are_refused(tmp_path):
    _, model = tiny("llama")
    with pytest.raises(ConfigError, match="FuyouTrainingArguments"):
        FuyouTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", report_to=[]))
    with pytest.raises(ConfigError, match="ssd_dirs is empty"):
        FuyouTrainer(
            model=model, args=FuyouTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", report_to=[])
        )


def test_resume_from_checkpoint_matches_uninterrupted(tmp_path):
    data = dataset()
    _, model = tiny("llama_tied", layers=2)
    init = copy.deepcopy(model.state_dict())

    def trainer(name, save_steps=None, max_steps=6):
        ssd = tmp_path / f"ssd-{name}"
        ssd.mkdir(exist_ok=True)
        _, m = tiny("llama_tied", layers=2)
        m.load_state_dict(init)
        kw = {**COMMON, "max_steps": max_steps}
        if save_steps:
            kw.update(save_strategy="steps", save_steps=save_steps)
        args = FuyouTrainingArguments(
            output_dir=str(tmp_path / name), optim="adamw_torch", ssd_dirs=[str(ssd)], cpu_memory="64MiB", **kw
        )
        return FuyouTrainer(model=m, args=args, train_dataset=data)

    straight = trainer("straight")
    straight.train()
    first = trainer("resumed", save_steps=3)
    first.train()  # runs all 6, leaving checkpoint-3 (and checkpoint-6) behind
    second = trainer("resumed", save_steps=3)
    second.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-3"))
    assert losses(second)[-3:] == pytest.approx(losses(straight)[-3:], rel=1e-6)
    a, b = straight.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _cpu_profile(path):
    """A hand-written CPU profile, so the planner's choice does not depend on this machine's measurements."""
    from fuyou.planner.profile import HardwareProfile, save_profile

    save_profile(
        HardwareProfile(
            name="tiny-cpu",
            device="cpu",
            ssd_read_Bps=2e8,
            ssd_write_Bps=1e8,
            adam_params_per_s=5e7,
            device_peak_flops=2e10,
            host_mem_Bps=5e9,
            h2d_Bps=5e9,
            d2h_Bps=5e9,
            device_memory_bytes=1 << 30,
            host_memory_bytes=1 << 30,
        ),
        str(path),
    )
    return str(path)


def test_trainer_runs_the_plan_the_shared_chooser_picks(tmp_path, capsys):
    """FuyouTrainer plans as `fuyou finetune` does: the same chooser, given the same request, picks the plan
    its engine runs (here, under a 2 MiB host budget, smaller state chunks and gradients parked on SSD — not
    the engine's default plan); `plan="rules"` keeps the budget rules."""
    from fuyou.engine import Plan
    from fuyou.run.plan_choice import PlanRequest, choose_plan

    cfg, model = tiny("llama_tied", layers=2)
    profile = _cpu_profile(tmp_path / "hw.json")
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    kw = {**COMMON, "max_steps": 2}
    args = FuyouTrainingArguments(
        output_dir=str(tmp_path / "fy"),
        optim="adamw_torch",
        ssd_dirs=[str(ssd)],
        cpu_memory="2MiB",
        seq_len=16,
        profile=profile,
        optimizer_state="fp32",  # 2 MiB is tight for fp32 state: the plan shrinks its chunk or parks gradients
        **(kw | {"max_steps": 4}),
    )
    fy = FuyouTrainer(model=model, args=args, train_dataset=dataset())
    req = PlanRequest(
        model_config=cfg,
        store_dirs=(str(ssd),),
        cpu_memory="2MiB",
        device="cpu",
        precision="fp32",
        optimizer_state="fp32",
        micro_batch_size=2,
        grad_accum=2,
        seq_len=16,
        clip=True,
        profile=profile,
    )
    chosen = choose_plan(req)
    assert fy.plan_choice.info["source"] == "planner" and fy.plan_choice.info["profile"] == profile
    assert fy.plan_choice.plan == chosen.plan
    assert fy.engine.plan == chosen.plan
    default = Plan(grad_accum=2, schedule="overlap_next_forward")
    assert chosen.plan.grad_accum == 2 and chosen.plan != default
    assert (chosen.plan.state_chunk, chosen.plan.park_ram_blocks) != (default.state_chunk, default.park_ram_blocks)
    assert "planner: 2 micro-batches" in capsys.readouterr().err
    fy.train()
    assert len(losses(fy)) == 4 and fy.plan_record()["executed"] == fy.engine.plan.to_json()
    # as `fuyou finetune` records in run.json: the prediction held against the steady steps (after 2 warm-up)
    check = fy.profile_check
    assert check is not None and check["predicted_step_s"] == fy.plan_choice.info["predicted_step_s"]
    assert check["measured_step_s"] > 0 and check["verdict"] in (
        "ok",
        "cost model (a profile file, not measured by the run)",
    )

    ssd2 = tmp_path / "ssd2"
    ssd2.mkdir()
    args = FuyouTrainingArguments(
        output_dir=str(tmp_path / "rules"),
        optim="adamw_torch",
        ssd_dirs=[str(ssd2)],
        cpu_memory="64MiB",
        plan="rules",
        **kw,
    )
    rules = FuyouTrainer(model=tiny("llama_tied", layers=2)[1], args=args, train_dataset=dataset())
    assert rules.plan_choice.info == {"source": "rules"} and rules.engine.plan.grad_accum == 2


@pytest.mark.slow  # ~9 s: two trainers (the engine-level balance tests stay in the default tier)
def test_a_mixture_of_experts_trains_with_the_balance_loss_trainer_computes(tmp_path):
    """A Mixtral config asking for the balance loss (``output_router_logits``): with one micro-batch
    per step, Trainer's loss (the HF model's own: cross-entropy + coef × aux) is Fuyou's."""
    cfg, model = tiny("mixtral", layers=2)
    model.config.output_router_logits = True
    ref_model = copy.deepcopy(model)
    data = dataset(n=16)
    common = COMMON | dict(gradient_accumulation_steps=1, per_device_train_batch_size=4, max_steps=4)
    ref, fy = plain_and_fuyou(tmp_path, ref_model, model, data, common, moe_balance="micro")
    assert len(losses(fy)) == 4
    assert losses(fy) == pytest.approx(losses(ref), rel=1e-5)
    ref_sd = ref_model.state_dict()
    close = total = 0
    for k, v in fy.model.state_dict().items():  # near-zero gradients make a few elements Adam-sensitive
        ok = (v - ref_sd[k]).abs() <= 1e-5 * ref_sd[k].abs().max() + 1e-12
        close, total = close + int(ok.sum()), total + ok.numel()
    assert close >= 0.98 * total


def peft_model(model, seed: int):
    """``model`` wrapped by ``peft`` (rank 4 on q, v and down projections), its adapters drawn with ``seed``:
    B from N(0, 0.02) instead of peft's zeros, so A trains from the first step."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return pm


def test_a_peft_model_trains_its_adapters_as_plain_trainer_does(tmp_path):
    """A ``peft`` LoRA model: Fuyou streams the base frozen and trains the adapters. Losses and
    adapter weights equal transformers.Trainer's on the same model; ``save_model`` writes a PEFT
    adapter directory that peft loads with the same logits. Other PEFT features are refused by name."""
    from peft import LoraConfig, PeftModel, get_peft_model

    _, model = tiny("qwen2", layers=2)
    fresh = copy.deepcopy(model)
    pm = peft_model(model, seed=1)
    ref_pm = copy.deepcopy(pm)
    data = dataset()
    ref, fy = plain_and_fuyou(tmp_path, ref_pm, pm, data)
    assert isinstance(fy.engine.lora, LoraState)
    assert losses(fy) == pytest.approx(losses(ref), rel=1e-5)
    want = {n: p for n, p in ref_pm.named_parameters() if p.requires_grad}
    got = dict(pm.named_parameters())
    assert want and all((got[n] - p).abs().max() <= 1e-5 * p.abs().max() + 1e-12 for n, p in want.items())
    fy.save_model(str(tmp_path / "adapter"))
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, ref_pm.eval()(input_ids=ids).logits, rtol=1e-4, atol=1e-5
        )
    dora = get_peft_model(copy.deepcopy(fresh), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ConfigError, match="FuyouTrainer trains PEFT models with no use_dora"):
        FuyouTrainer(model=dora, args=fy.args, train_dataset=data)
