"""LoRA on a frozen, streamed base equals ``peft`` + ``torch.optim.AdamW`` (fp32), and its outputs
load back: the PEFT adapter directory in ``peft``, the merged model in ``transformers``."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.errors import ConfigError
from fuyou.models.families import untrained
from fuyou.models.lora import LoraSettings, excluded, is_lora
from tests.integration.tiny_models import batches, hf_balance, tiny

LR, WD, STEPS = 1e-3, 0.01, 5


def peft_reference(model, settings: LoraSettings, data, K: int, clip: float):
    """The peft-wrapped model trained by plain PyTorch: AdamW over the LoRA weights, K micro-batches
    per step, ``clip_grad_norm_``. Returns (peft model, losses, LoRA init by Fuyou's parameter names)."""
    from peft import get_peft_model

    torch.manual_seed(5)
    pm = get_peft_model(model, settings.peft_config())
    init = {k.removeprefix("base_model.model."): v.detach().clone() for k, v in pm.state_dict().items() if is_lora(k)}
    with torch.no_grad():  # peft starts B at zero: give B values so A's gradients are not zero at the start
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
                init[n.removeprefix("base_model.model.")] = p.detach().clone()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    losses = []
    for ids, labels in data:
        n_items = int((labels[:, 1:] != -100).sum())
        opt.zero_grad()
        total = 0.0
        for mi, ml in zip(ids.chunk(K), labels.chunk(K)):
            loss = pm(input_ids=mi, labels=ml, num_items_in_batch=n_items).loss
            loss.backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        losses.append(total)
    return pm, losses, init


def run(cfg, base_sd, init, settings, tmp_path, data, *, K, policy, clip):
    nblocks = cfg.num_hidden_layers + 2
    plan = Plan(grad_accum=K, activation_policy=("keep",) + (policy,) * (nblocks - 2) + ("keep",))
    (tmp_path / "ssd").mkdir(exist_ok=True)
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path / "ssd"),), precision="fp32", lr=LR, weight_decay=WD, cpu_memory="256MiB",
        max_grad_norm=clip, plan=plan, lora=settings,
    )  # fmt: skip
    eng = Engine.from_state_dict(cfg, {**base_sd, **init}, ec)
    results = [eng.train_step(ids, labels) for ids, labels in data]
    return eng, results


@pytest.mark.parametrize(
    "family, policy, K, clip",
    [("llama", "keep", 1, 0.0), ("qwen2", "recompute", 2, 0.005), ("llama_tied", "swap_cpu", 2, 0.01)],
)
def test_lora_trains_as_peft(tmp_path, family, policy, K, clip):
    cfg, model = tiny(family)
    base_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    settings = LoraSettings(rank=4, alpha=8)
    data = batches(STEPS)
    pm, ref_losses, init = peft_reference(model, settings, data, K, clip)
    eng, results = run(cfg, base_sd, init, settings, tmp_path, data, K=K, policy=policy, clip=clip)
    try:
        assert all(r.applied for r in results) and all(r.ssd_write_bytes == 0 for r in results)  # a frozen base
        assert not clip or all(r.grad_norm > clip for r in results)  # the clipping cases clip every step
        assert [r.loss for r in results] == pytest.approx(ref_losses, rel=1e-5)
        ref = {k.removeprefix("base_model.model."): v for k, v in pm.state_dict().items() if is_lora(k)}
        got = eng.lora.state_dict()
        assert set(got) == set(ref) and len(got) > 0
        for k, v in got.items():
            assert (v - ref[k]).abs().max() <= 1e-5 * ref[k].abs().max() + 1e-12, k
        base = dict(eng.master_weights())
        assert all(torch.equal(base[k], base_sd[k]) for k in base)  # never rewritten
        from fuyou.schedule import sizing

        assert eng.plan.lora_base and not any(e.name.startswith("s/") for e in eng.store.extents)  # no optimizer state
        classes = [c.name for c in sizing.buffer_classes(eng.layout.footprint(), eng.plan)]
        assert classes == [sizing.WEIGHTS, sizing.ADAPTERS]  # weights in; the adapters' checkpoint staging
    finally:
        eng.close()


@pytest.mark.parametrize(
    "family, targets",
    [("llama", ("q_proj", "v_proj", "down_proj")), pytest.param("gpt2", ("c_attn", "c_fc"), marks=pytest.mark.slow)],
)  # GPT-2's Conv1D weights are [in, out]: the merge transposes its update
def test_adapter_and_merged_model_load_back_with_the_same_logits(tmp_path, family, targets):
    from peft import PeftModel

    cfg, model = tiny(family)
    base_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    settings = LoraSettings(rank=4, alpha=8, targets=targets)
    data = batches(2)
    src = tmp_path / "base"
    model.save_pretrained(src)
    fresh = copy.deepcopy(model)
    pm, _, init = peft_reference(model, settings, data, 1, 0.0)
    eng, _ = run(cfg, base_sd, init, settings, tmp_path, data, K=1, policy="keep", clip=0.0)
    eng.source_dir = str(src)
    try:
        eng.export_adapter(str(tmp_path / "adapter"))
        eng.export(str(tmp_path / "merged"), dtype="fp32")
    finally:
        eng.close()
    assert not (tmp_path / "adapter.partial").exists()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))
    pm.eval()
    with torch.no_grad():
        want = pm(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
        assert loaded.peft_config["default"].r == 4
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


def test_fuyou_finetune_with_lora_writes_an_adapter_and_a_merged_model(tmp_path):
    """The CLI with its defaults (planner, clipping) and ``--lora-rank``: the base is read, never
    written; OUTPUT/adapter loads in peft onto the base, OUTPUT/model (``--merge``) in transformers,
    with the same logits."""
    import json

    from click.testing import CliRunner
    from peft import PeftModel

    from cli.main import main
    from tests.integration.tiny_models import cli_inputs

    model_dir, data = cli_inputs(tmp_path)
    out = tmp_path / "run"
    args = ["finetune", model_dir, "--data", data, "--output", str(out), "--steps", "3", "--seq-len", "32"]
    r = CliRunner().invoke(
        main, [*args, "--lora-rank", "4", "--lora-targets", "q_proj,v_proj", "--merge", "--no-progress"]
    )
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(x["applied"] and x["ssd_write_gb"] == 0 for x in lines)
    run_json = json.loads((out / "run.json").read_text())
    assert run_json["output"] == str(out / "adapter")
    ids = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out / "adapter")(
            input_ids=ids
        ).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "model")(input_ids=ids).logits
    torch.testing.assert_close(merged, peft_logits, rtol=1e-3, atol=1e-3)


def test_a_lora_run_resumes_bit_identically(tmp_path):
    """Two steps, close, ``Engine.resume``, two more: the adapters and losses are an uninterrupted
    run's bit for bit (the store's ``lora`` extent holds them and their AdamW moments). A store
    with adapters refuses to resume as full fine-tuning, and a LoRA run of other targets."""
    from fuyou.errors import ConfigError

    cfg, model = tiny("qwen2")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    settings = LoraSettings(rank=4, alpha=8)
    data = batches(4)

    def engine_config(d, lora=settings):
        d.mkdir(exist_ok=True)
        return EngineConfig(
            ssd_dirs=(str(d),), precision="fp32", lr=LR, weight_decay=WD, cpu_memory="256MiB", max_grad_norm=0.01,
            plan=Plan(grad_accum=2), lora=lora,
        )  # fmt: skip

    torch.manual_seed(0)
    with Engine.from_state_dict(cfg, sd, engine_config(tmp_path / "a")) as eng:
        whole = [eng.train_step(*b).loss for b in data]
        want = eng.lora.state_dict()
    torch.manual_seed(0)
    with Engine.from_state_dict(cfg, sd, engine_config(tmp_path / "b")) as eng:
        first = [eng.train_step(*b).loss for b in data[:2]]
    with pytest.raises(ConfigError, match="holds LoRA adapters; resume with the --lora-\\* settings"):
        Engine.resume(engine_config(tmp_path / "b", lora=None))
    with pytest.raises(ConfigError, match="LoRA adapters of another rank or targets"):
        Engine.resume(engine_config(tmp_path / "b", lora=LoraSettings(rank=2, alpha=8)))
    with Engine.resume(engine_config(tmp_path / "b")) as eng:
        assert eng.step == 2
        rest = [eng.train_step(*b).loss for b in data[2:]]
        got = eng.lora.state_dict()
    assert first + rest == whole
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_bad_lora_settings_are_refused_in_one_line(tmp_path):
    from fuyou.errors import ConfigError
    from fuyou.models.adapters import make_adapter
    from fuyou.run.config import FinetuneConfig

    for kw, words in [
        (dict(lora_rank=0), "--lora-rank must be an integer ≥ 1"),
        (dict(lora_rank=4, lora_dropout=1.5), "--lora-dropout must be in [0, 1)"),
        (dict(merge=True), "--merge and --lora-alpha need --lora-rank"),
    ]:
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace(")", r"\)")):
            FinetuneConfig(**kw)
    cfg, _ = tiny("llama")
    with pytest.raises(ConfigError, match="matches no layer of this model.*its linear layers are .*q_proj"):
        make_adapter(cfg, LoraSettings(rank=2, alpha=4, targets=("qkv",)))


@pytest.mark.slow  # ~30 s: three CLI runs
def test_a_killed_lora_run_resumes_from_its_checkpoint_bit_identically(tmp_path):
    """``fuyou finetune --lora-rank 4 --save-every 1 --resume auto`` killed (SIGKILL) once a checkpoint
    exists, then run again: its adapter and losses are a clean run's, bit for bit."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    from fuyou.checkpoint import list_checkpoints
    from tests.integration.tiny_models import cli_inputs

    model_dir, data = cli_inputs(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def command(out):
        return [
            sys.executable, "-m", "fuyou.cli.main", "finetune", model_dir, "--data", data, "--output", str(out),
            "--steps", "8", "--seq-len", "32", "--lora-rank", "4", "--lr", "1e-3", "--save-every", "1",
            "--resume", "auto", "--no-progress",
        ]  # fmt: skip

    subprocess.run(command(tmp_path / "clean"), cwd=root, check=True, capture_output=True, timeout=600)
    killed = tmp_path / "killed"
    child = subprocess.Popen(command(killed), cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list_checkpoints([str(killed / "store")]) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.poll() is None, "the run finished before it could be killed"
    child.send_signal(signal.SIGKILL)
    child.wait()
    r = subprocess.run(command(killed), cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((killed / "run.json").read_text())["resumed_from_step"] >= 1
    a = load_file(str(tmp_path / "clean" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(killed / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[json.loads(x)["loss"] for x in open(d / "metrics.jsonl")] for d in (tmp_path / "clean", killed)]
    assert losses[0] == losses[1] and len(losses[0]) == 8


@pytest.mark.parametrize(
    "family",
    [
        "mixtral",
        pytest.param("deepseek_v3", marks=pytest.mark.slow),
        pytest.param("qwen2_moe", marks=pytest.mark.slow),
        "qwen3_5_moe",
        pytest.param("gpt_oss", marks=pytest.mark.slow),
        pytest.param("glm4_moe", marks=pytest.mark.slow),
        pytest.param("llama4", marks=pytest.mark.slow),  # its router (a linear layer returning a tuple) left out
        pytest.param("gemma4_moe", marks=pytest.mark.slow),
        pytest.param("glm_moe_dsa", marks=pytest.mark.slow),  # its indexers (never trained) left out
    ],
)
def test_lora_on_a_mixture_of_experts_trains_as_peft(tmp_path, family):
    """``all-linear`` on a mixture of experts: what peft targets (Mixtral, DeepSeek-V3: every expert's
        fused tensors, each expert its own rank-r pair, and the router — GLM-4.5 too; Qwen2-MoE: its shared
        expert; Qwen3.5-MoE: its shared expert and gate, linear- and full-attention projections; GPT-OSS: the
        attention projections; Llama 4: its shared expert, dense layers and attention, not its router; Gemma 4:
        its dense MLP, attention and the router's projection, not the experts beside them; GLM-5: not its
    indexers, which transformers runs without gradient) trains
        as peft + AdamW with the default global balance loss (DeepSeek-V3: none, its routing bias kept),
        clipping and accumulation on; the merged export and the adapter load back with peft's logits."""
    from peft import PeftModel, get_peft_model

    from tests.integration.tiny_models import reference_steps

    cfg, model = tiny(family)
    src = tmp_path / "base"
    model.save_pretrained(src)
    fresh = copy.deepcopy(model)
    base_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    settings = LoraSettings(rank=4, alpha=8)
    data = batches(STEPS)
    torch.manual_seed(5)
    pm = get_peft_model(model, settings.peft_config(exclude=excluded(model, untrained(cfg))))  # as Fuyou: no router
    with torch.no_grad():  # B away from zero, so that A trains from the first step
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    init = {k.removeprefix("base_model.model."): v.detach().clone() for k, v in pm.state_dict().items() if is_lora(k)}
    if family in ("mixtral", "deepseek_v3", "glm4_moe"):  # the others: peft's all-linear leaves routed experts out
        assert any(".experts" in k for k in init) and any(".mlp.gate." in k for k in init)
    balance = hf_balance(cfg)
    ref_losses = reference_steps(pm.base_model.model, data, 2, LR, WD, clip=0.5, balance=balance)
    eng, results = run(cfg, base_sd, init, settings, tmp_path, data, K=2, policy="recompute", clip=0.5)
    eng.source_dir = str(src)
    try:
        assert [r.loss for r in results] == pytest.approx(ref_losses, rel=1e-5)
        ref = {k.removeprefix("base_model.model."): v for k, v in pm.state_dict().items() if is_lora(k)}
        got = eng.lora.state_dict()
        assert set(got) == set(ref)
        for k, v in got.items():
            assert (v - ref[k]).abs().max() <= 1e-5 * ref[k].abs().max() + 1e-12, k
        eng.export_adapter(str(tmp_path / "adapter"))
        eng.export(str(tmp_path / "merged"), dtype="fp32")
    finally:
        eng.close()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))
    pm.eval()
    with torch.no_grad():
        want = pm(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


def test_lora_on_experts_split_into_groups_is_refused_in_one_line():
    from fuyou.errors import ConfigError
    from fuyou.models.adapters import make_adapter

    cfg, _ = tiny("mixtral")
    with pytest.raises(ConfigError, match="LoRA on the experts .* not 2 expert groups"):
        make_adapter(cfg, LoraSettings(rank=4, alpha=8), expert_groups=2)
    make_adapter(cfg, LoraSettings(rank=4, alpha=8, targets=("q_proj",)), expert_groups=2)  # experts not targeted


def test_a_router_named_as_a_lora_target_is_refused_in_one_line(tmp_path):
    """Llama 4's router is a linear layer whose forward returns scores and logits: LoRA cannot adapt it."""
    from fuyou.models.adapters import make_adapter

    cfg, _ = tiny("llama4")
    with pytest.raises(ConfigError, match="--lora-targets names router: .* leave it out"):
        make_adapter(cfg, LoraSettings(rank=4, alpha=8, targets=("router", "q_proj")))


def test_layers_the_family_never_trains_get_no_adapters():
    """DeepSeek-V3.2's and GLM-5's indexers run without gradient in transformers (``families.UNTRAINED``):
    ``all-linear`` leaves them out, by full name, and so does the adapter's config."""
    from fuyou.models.adapters import make_adapter

    cfg, _ = tiny("glm_moe_dsa")
    names = [n for n, _ in make_adapter(cfg, LoraSettings(rank=4, alpha=8)).model.named_parameters() if is_lora(n)]
    assert names and not any(".indexer." in n for n in names)
    assert any(".self_attn.q_a_proj." in n for n in names)
    bare = make_adapter(cfg).model
    assert "model.layers.0.self_attn.indexer.wk" in excluded(bare, untrained(cfg))
    assert not any("indexer" in n for n in excluded(bare))
