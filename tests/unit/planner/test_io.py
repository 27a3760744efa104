"""Shapes from configs, profile and result JSON round trips, the CLI, and the no-torch import rule."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from fuyou.errors import ConfigError
from fuyou.models.description import describe_model, load_description
from fuyou.planner.profile import ComputePoint, HardwareProfile, load_profile, save_profile
from fuyou.planner.result import Budgets, PlannerResult
from fuyou.planner.search import Request, search
from tests.integration.tiny_models import FAMILIES
from tests.unit.planner.helpers import profile, small_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LOHAN = os.path.join(ROOT, "bench", "profiles", "lohan_4090.json")


def test_named_shapes_and_errors(tmp_path):
    s = load_description("GPT-3-13B")
    assert s.layers == 40 and s.hidden == 5120 and 12.8e9 < s.params < 12.9e9
    assert s.blocks[-1].borrows == ("embed",)
    with pytest.raises(ConfigError, match="named shape"):
        load_description(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="bert"):
        load_description(str(tmp_path))


def test_the_planner_sizes_host_memory_from_the_engines_footprint():
    """Host sizing is written once (``fuyou.schedule.sizing``); what each side feeds it must agree: the
    footprint the planner derives from a config alone equals the one the engine's layout gives (bf16),
    and is never below it (fp32, whose 64-byte tensor gaps are fewer elements)."""
    import torch

    from fuyou.models.adapters import make_adapter
    from fuyou.models.freeze import frozen_keys
    from fuyou.models.store_layout import ModelLayout
    from fuyou.schedule.state_format import FORMATS
    from tests.integration.tiny_models import tiny

    for fam in FAMILIES:
        cfg, _ = tiny(fam, hidden=72)
        blocks = tuple(make_adapter(cfg).blocks)
        shape = describe_model(cfg)
        fixed = frozen_keys(blocks, ())  # the family's buffers (DeepSeek-V3's routing bias): read-only
        assert ModelLayout(blocks, frozen_params=fixed).footprint() == shape.footprint(2, FORMATS["fp32"])
        legacy = FORMATS["fp32-bf16"]
        assert ModelLayout(blocks, optimizer_state=legacy, frozen_params=fixed).footprint() == shape.footprint(
            2, legacy
        )
        split = ModelLayout(blocks, optimizer_state=FORMATS["split"], frozen_params=fixed)
        assert split.footprint() == shape.footprint(2, FORMATS["split"])
        int8 = ModelLayout(blocks, optimizer_state=FORMATS["int8"], frozen_params=fixed)
        assert int8.footprint() == shape.footprint(2, FORMATS["int8"])
        fp32, planned = (
            ModelLayout(blocks, torch.float32, frozen_params=fixed).footprint(),
            shape.footprint(4, FORMATS["fp32"]),
        )
        assert fp32.numels == tuple(-(-w // 4) for w in fp32.weight_bytes) and fp32.borrowed == planned.borrowed
        assert all(e <= p for e, p in zip(fp32.weight_bytes, planned.weight_bytes))


def test_profile_json_round_trip(tmp_path):
    p = profile(compute=(ComputePoint(256, 1e11, 8e10, 256), ComputePoint(64, 5e10, 4e10, 64)), notes={"a": 1})
    path = str(tmp_path / "hw.json")
    save_profile(p, path)
    q = load_profile(path)
    assert q == p and [c.tokens for c in q.compute] == [64, 256]
    assert q.flops_per_s(160) == pytest.approx(7.5e10) and q.flops_per_s(10) == 5e10 and q.flops_per_s(999) == 1e11
    assert load_profile(LOHAN).device_peak_flops == 165e12
    bad = {**p.to_json(), "ssd_read_GBps": 3}
    with pytest.raises(ConfigError, match="ssd_read_GBps"):
        HardwareProfile.from_json(bad)
    with pytest.raises(ConfigError, match="ssd_read_Bps must be > 0"):
        HardwareProfile.from_json({**p.to_json(), "ssd_read_Bps": 0})


def test_result_json_round_trip():
    gib = 1 << 30
    r = search(
        small_llama(),
        profile(device_peak_flops=1e12, ssd_read_Bps=2e9, ssd_write_Bps=2e9),
        Budgets(cpu_memory=4 * gib, gpu_memory=gib),
        Request(seq_len=128, tokens_per_step=512),
    )
    back = PlannerResult.from_json(json.loads(json.dumps(r.to_json())))
    assert back == r and back.plan.activation_policy == r.plan.activation_policy
    assert r.plan.state_chunk % 32 == 0  # the plan carries every choice, the state chunk included


def test_planner_imports_without_torch():
    code = (
        "import sys; import fuyou.planner.search, fuyou.planner.measure, fuyou.cli.plan_cmd; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_plan_prints_and_writes_json(tmp_path):
    from fuyou.cli.plan_cmd import plan_cmd

    out = tmp_path / "plan.json"
    r = CliRunner().invoke(
        plan_cmd,
        [
            "GPT-3-13B",
            "--profile",
            LOHAN,
            "--tokens-per-step",
            "8192",
            "--cpu-memory",
            "700GiB",
            "--gpu-memory",
            "22GiB",
            "--json",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    for word in ("micro-batch", "TFLOPS", "drive-writes/day", "bottleneck", "6·N_matmul"):
        assert word in r.output
    d = json.loads(out.read_text())  # 700 GiB holds all 13 B params' weights and state: no SSD traffic
    assert d["prediction"]["bottleneck"] == "compute"
    assert d["plan"]["ram_weight_blocks"] == d["plan"]["ram_state_blocks"] == 42
    r = CliRunner().invoke(
        plan_cmd,
        [
            "GPT-3-13B",
            "--profile",
            LOHAN,
            "--tokens-per-step",
            "8192",
            "--cpu-memory",
            "64GiB",
            "--gpu-memory",
            "22GiB",
            "--json",
            str(out),
        ],
    )
    d = json.loads(out.read_text())  # 64 GiB: most state stays on SSD, which bounds the step at batch 8
    assert d["prediction"]["bottleneck"] == "ssd" and d["plan"]["ram_state_blocks"] <= 42 // 10
    assert "clipping at global norm 1" in r.output  # fuyou finetune's default
    r = CliRunner().invoke(plan_cmd, ["GPT-3-13B", "--profile", LOHAN, "--gpu-memory", "1GiB"])
    assert r.exit_code != 0 and "device memory" in str(r.exception)


@pytest.mark.slow  # ~14 s
def test_cli_plan_precision_sizes_the_store_and_buffers(tmp_path):
    """``--precision fp32`` plans 4-byte weights and gradients: with an fp32 master a bigger store than the
    default's (bf16, split master); with a split master the same store, the fp32 weights being the master."""
    from fuyou.cli.plan_cmd import plan_cmd

    sizes = {}
    for p, fmt in (("fp32", "fp32"), ("bf16", "split"), ("fp32", "split")):
        out = tmp_path / f"{p}-{fmt}.json"
        r = CliRunner().invoke(
            plan_cmd,
            [
                "llama-3-8b",
                "--profile",
                LOHAN,
                "--tokens-per-step",
                "2048",
                "--seq-len",
                "1024",
                "--cpu-memory",
                "64GiB",
                "--gpu-memory",
                "22GiB",
                "--precision",
                p,
                "--optimizer-state",
                fmt,
                "--max-grad-norm",
                "0",
                "--json",
                str(out),
            ],
        )
        assert r.exit_code == 0, r.output
        sizes[p, fmt] = json.loads(out.read_text())["prediction"]["memory"]["ssd"]
    assert sizes["fp32", "fp32"] > sizes["bf16", "split"] == sizes["fp32", "split"]


def test_cli_plan_puts_block_inputs_in_host_ram_where_a_24gb_gpu_cannot_hold_them(tmp_path):
    """65k tokens/step of GPT-3-13B on a 4090 (LoHan's compute-bound regime): block inputs alone need
    25.6 GiB, more than the 22 GiB budget. The plan recomputes with them in host RAM (recompute_cpu,
    which the engine runs), within both budgets and compute-bound."""
    from click.testing import CliRunner

    from fuyou.cli.plan_cmd import plan_cmd

    out = tmp_path / "plan.json"
    args = ["GPT-3-13B", "--profile", LOHAN, "--cpu-memory", "700GiB", "--gpu-memory", "22GiB"]
    r = CliRunner().invoke(plan_cmd, [*args, "--tokens-per-step", "65536", "--json", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert "recompute_cpu" in d["plan"]["activation_policy"]
    mem = d["prediction"]["memory"]
    assert mem["device"] <= 22 << 30 and mem["host_activations"] >= 25 << 30
    assert d["prediction"]["bottleneck"] == "compute"


def test_soft_capped_attention_counts_the_scores_a_layer_keeps():
    """Gemma 2 trains with eager attention (its scores are soft-capped): a layer keeps ``heads × T``
    bytes more per token as T grows (tanh and fp32 softmax outputs, bf16 probabilities: 8 per score).
    The planner's coefficient is what a real bf16 layer's saved tensors measure; sdpa families keep none."""
    import torch

    from tests.integration.tiny_models import tiny

    cfg, model = tiny("gemma2", layers=2)
    model = model.to(torch.bfloat16)
    layer, rot = model.model.layers[1], model.model.rotary_emb
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def saved_bytes(T: int) -> int:
        x = torch.randn(1, T, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        pos = torch.arange(T)[None]
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x, attention_mask=None, position_embeddings=rot(x, pos), position_ids=pos)
        return sum(n for ptr, n in seen.items() if ptr not in params)

    per_key = (saved_bytes(128) / 128 - saved_bytes(64) / 64) / 64
    planned = describe_model(cfg).blocks[1].act_bytes_per_token_per_key
    assert planned == 8 * cfg.num_attention_heads and abs(per_key - planned) <= 0.05 * planned
    assert describe_model(tiny("gemma3")[0]).blocks[1].act_bytes_per_token_per_key == 0


def test_the_planner_counts_the_adapters_peft_injects():
    """``ModelShape.lora_params(r)`` equals the LoRA parameters ``peft`` adds with ``all-linear`` to
    every family, a mixture of experts' fused expert tensors and routers included where peft targets
    them, and the planner puts 16 B of device memory on each."""
    from fuyou.models.adapters import make_adapter
    from fuyou.models.lora import LoraSettings, is_lora
    from fuyou.planner.graph import StepConfig
    from fuyou.schedule.device_memory import ADAPTER_BYTES_PER_PARAM
    from tests.integration.tiny_models import tiny

    for fam in FAMILIES:
        cfg, _ = tiny(fam, hidden=72)
        ad = make_adapter(cfg, LoraSettings(rank=3, alpha=6))
        real = sum(p.numel() for n, p in ad.model.named_parameters() if is_lora(n))
        assert describe_model(cfg).lora_params(3) == real, fam
    shape = describe_model(tiny("llama", hidden=72)[0].to_dict())
    from fuyou.planner.cost import memory
    from fuyou.schedule.plan import Plan
    from tests.unit.planner.helpers import profile

    hw = profile()
    base = memory(shape, Plan(lora_base=True), StepConfig(1, 16), hw).device
    with_adapters = memory(shape, Plan(lora_base=True), StepConfig(1, 16, adapter_params=1000), hw).device
    assert with_adapters - base == 1000 * ADAPTER_BYTES_PER_PARAM


def test_cli_plan_splits_a_llama3_vocabulary_that_sets_the_host_floor(tmp_path):
    """Llama-3-8B's 128 k × 4096 embedding and head are 2.4 decoder layers each: at 3 GiB of host memory
    (fp32 state ÷ 32) `fuyou plan` streams both as 3 blocks of vocabulary rows and says so; at 12 GiB
    it leaves them whole."""
    from click.testing import CliRunner

    from fuyou.cli.plan_cmd import plan_cmd

    args = ["llama-3-8b", "--profile", LOHAN, "--gpu-memory", "22GiB", "--seq-len", "1024", "--max-grad-norm", "0"]
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(plan_cmd, [*args, "--cpu-memory", "3GiB", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "│ vocabulary" in r.output  # the row naming the split
    d = json.loads(out.read_text())
    assert d["plan"]["vocab_groups"] == 3 and d["prediction"]["memory"]["host"] <= 3 << 30
    r = CliRunner().invoke(plan_cmd, [*args, "--cpu-memory", "12GiB", "--json", str(out)])
    assert r.exit_code == 0 and "│ vocabulary" not in r.output
    assert json.loads(out.read_text())["plan"]["vocab_groups"] == 1
