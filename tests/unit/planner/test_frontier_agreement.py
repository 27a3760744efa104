"""``fuyou plan`` and ``bench/bench_frontier_plans.py`` search the same request and give the same answer
(issue 33: the bench refused GLM-4.5 and DeepSeek-V3 on box 1 where ``fuyou plan`` planned them)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from bench.bench_frontier_plans import inputs
from fuyou.cli.main import main
from fuyou.models.description import load_description
from fuyou.planner.profile import load_profile
from fuyou.planner.search import search

PROFILE = "bench/profiles/lohan_4090.json"
CPU, GPU = "1300MiB", "1GiB"
"""``small_llama`` (a 120 M-parameter Llama) at 65,536 tokens a step: its block inputs (864 MiB) exceed the device, so they
wait in host RAM (``recompute_cpu``), and with clipping they and every block's parked gradient do not fit
the host together. Before the fix the search sized the buffers and parked gradients for the whole host
budget, then found no room for the inputs: infeasible with clipping (the bench), a plan without (``fuyou
plan``'s default)."""


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    """``small_llama``'s config.json, which ``fuyou plan`` and the tests describe alike (one description,
    cached by ``load_description``: its blocks are probed once)."""
    cfg = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8}
    cfg |= {"num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000}
    path = tmp_path_factory.mktemp("small") / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_the_frontier_bench_plans_what_fuyou_plan_plans_with_clipping(config):
    """The bench's budgets and request are ``fuyou plan``'s with ``--max-grad-norm 1`` (clipping on, as
    ``fuyou finetune`` runs by default), and both answer with the same plan: block inputs in host RAM,
    the last block's gradient parked on SSD to leave them room."""
    prof = load_profile(PROFILE)
    bud, req = inputs(prof, CPU, GPU)
    assert req.clip and req.seq_len == 2048 and req.tokens_per_step == 65536
    args = ["plan", config, "--profile", PROFILE, "--cpu-memory", CPU, "--gpu-memory", GPU]
    args += ["--seq-len", "2048", "--tokens-per-step", "65536", "--max-grad-norm", "1", "--json", "-"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    cli = json.loads(r.output)
    res = search(load_description(config), prof, bud, req)
    bench = json.loads(json.dumps(res.to_json()))
    assert cli["plan"] == bench["plan"] and cli["budgets"] == bench["budgets"]
    plan, mem = res.plan, res.prediction.memory
    assert "recompute_cpu" in plan.activation_policy and mem.host_activations > 0
    assert plan.park_ram_blocks is not None and plan.park_ram_blocks < len(plan.activation_policy)
    assert mem.host <= bud.cpu_memory


def test_clipping_leaves_block_inputs_room_in_host_ram(config):
    """Without clipping the same run fits too (``fuyou plan``'s default request): clipping moves parked
    gradients to SSD, never turns a plan into a refusal."""
    prof = load_profile(PROFILE)
    bud, req = inputs(prof, CPU, GPU)
    shape = load_description(config)
    plain = search(shape, prof, bud, dataclasses.replace(req, clip=False))
    clipped = search(shape, prof, bud, req)
    for r in (plain, clipped):
        assert "recompute_cpu" in r.plan.activation_policy and r.prediction.memory.host <= bud.cpu_memory
    assert plain.plan.park_ram_blocks is None and clipped.plan.schedule == "overlap_next_forward"


@pytest.mark.parametrize("clip,lora", [(True, None), (False, 8)])
def test_fuyou_finetune_plans_what_fuyou_plan_plans(config, tmp_path, clip, lora):
    """``fuyou finetune``'s plan chooser and ``fuyou plan`` build the search's inputs in one place
    (``search.plan_inputs``): the same settings give the same plan, budgets and predicted step."""
    from transformers import AutoConfig

    from fuyou.models.lora import LoraSettings
    from fuyou.run.plan_choice import PlanRequest, _predicted_step_s, choose_plan

    model = AutoConfig.for_model(**json.loads(open(config).read()))
    req = PlanRequest(
        model_config=model, store_dirs=(str(tmp_path),), cpu_memory=CPU, gpu_memory=GPU, profile=PROFILE,
        micro_batch_size=2, grad_accum=4, seq_len=2048, clip=clip, precision="bf16",
        lora=LoraSettings(rank=lora, alpha=16) if lora else None,
    )  # fmt: skip
    chosen = choose_plan(req)
    args = ["plan", config, "--profile", PROFILE, "--cpu-memory", CPU, "--gpu-memory", GPU, "--seq-len", "2048"]
    args += ["--tokens-per-step", str(2048 * 2 * 4), "--micro-batch-size", "2", "--max-grad-norm", str(float(clip))]
    args += ["--lora-rank", str(lora), "--json", "-"] if lora else ["--json", "-"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    cli = json.loads(r.output)
    assert json.loads(json.dumps(chosen.info["plan"])) == cli["plan"]
    assert chosen.info["predicted_step_s"] == pytest.approx(cli["prediction"]["step_s"], rel=1e-12)
    assert chosen.info["predicted_device_bytes"] == cli["prediction"]["memory"]["device"]
    # a run's check of its profile (``check_profile``) predicts the same plan again with the search's own step
    again = _predicted_step_s(req, load_profile(PROFILE), chosen)
    assert again == pytest.approx(chosen.info["predicted_step_s"], rel=1e-12)
