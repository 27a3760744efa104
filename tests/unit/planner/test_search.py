"""The plan search: fits the budgets, never slower with more memory, names the binding constraint."""

import re

import pytest

from fuyou.planner.cost import host_buffers
from fuyou.planner.graph import StepConfig
from fuyou.planner.result import Budgets
from fuyou.planner.search import InfeasibleError, Request, search
from fuyou.schedule.device_memory import ALLOWANCE
from fuyou.schedule.plan import Plan
from tests.unit.planner.helpers import profile, small_llama

GiB = 1 << 30
MiB = 1 << 20
HW = profile(
    ssd_read_Bps=2e9,
    ssd_write_Bps=2.5e9,
    adam_params_per_s=1.5e9,
    h2d_Bps=1e10,
    d2h_Bps=1e10,
    pageable_Bps=5e9,
    host_mem_Bps=1e10,
    device_mem_Bps=5e11,
    device_peak_flops=2e12,
    flops_efficiency=0.7,
    flops_half_tokens=256,
    commit_s=0.003,
)
REQ = Request(seq_len=256, tokens_per_step=2048)


def test_result_fits_budgets_and_is_executable():
    r = search(small_llama(), HW, Budgets(cpu_memory=2 * GiB, gpu_memory=1 * GiB), REQ)
    m = r.prediction.memory
    assert m.device <= GiB and m.host <= 2 * GiB
    assert r.plan.grad_accum * r.step.micro_batch_size * 256 == 2048
    assert len(r.plan.activation_policy) == 10 and r.considered > 5


def test_the_search_works_out_each_candidates_memory_once(monkeypatch):
    """The policy assignment and the scans ask for the same candidates' memory again; each (plan, config)
    is worked out once per search (``_Search.memory``), and the result is the one without the memo."""
    from fuyou.planner import search as planner

    asked: list[tuple[Plan, StepConfig]] = []
    memory = planner.memory
    monkeypatch.setattr(planner, "memory", lambda m, p, c, hw: asked.append((p, c)) or memory(m, p, c, hw))
    bud = Budgets(cpu_memory=int(0.6 * GiB), gpu_memory=int(0.35 * GiB))
    r = search(small_llama(), HW, bud, REQ)
    assert len(asked) == len(set(asked)) > 20
    monkeypatch.setattr(planner._Search, "memory", lambda self, p, c: memory(self.m, p, c, self.hw))
    assert search(small_llama(), HW, bud, REQ) == r


def test_more_memory_never_predicts_a_slower_step():
    times = []
    for cpu, gpu in [(0.4, 0.35), (0.6, 0.35), (1, 0.5), (2, 0.5), (2, 1), (4, 2), (8, 4)]:
        r = search(small_llama(), HW, Budgets(cpu_memory=int(cpu * GiB), gpu_memory=int(gpu * GiB)), REQ)
        times.append(r.prediction.step_s)
    assert all(b <= a * (1 + 1e-9) for a, b in zip(times, times[1:])), times


def test_clipping_forces_the_next_forward_schedule():
    r = search(small_llama(), HW, Budgets(cpu_memory=2 * GiB, gpu_memory=GiB), Request(256, 2048, clip=True))
    assert r.plan.schedule == "overlap_next_forward"


@pytest.mark.parametrize(
    "budgets, words",
    [
        (Budgets(cpu_memory=2 * GiB, gpu_memory=100 << 20), ["device memory", "--gpu-memory", "--seq-len", "MiB"]),
        (Budgets(cpu_memory=50 << 20, gpu_memory=GiB), ["host memory", "--cpu-memory", "MiB"]),
        (Budgets(cpu_memory=2 * GiB, gpu_memory=GiB, ssd_bytes=1 << 30), ["SSD space", "--ssd", "GiB"]),
    ],
)
def test_infeasible_budgets_name_the_binding_constraint(budgets, words):
    with pytest.raises(InfeasibleError) as e:
        search(small_llama(), HW, budgets, REQ)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_block_inputs_go_to_host_ram_when_the_device_cannot_hold_them():
    """64k tokens of block inputs do not fit 1 GiB of device memory: the plan recomputes with the
    inputs in host RAM (recompute_cpu), which the engine runs; with too little host RAM for them
    too, the error names both budgets in one line."""
    big = Request(seq_len=1024, tokens_per_step=64 * 1024)
    r = search(small_llama(), HW, Budgets(cpu_memory=16 * GiB, gpu_memory=GiB), big)
    assert "recompute_cpu" in r.plan.activation_policy
    m = r.prediction.memory
    assert m.device <= GiB and m.host <= 16 * GiB and m.host_activations > 0
    with pytest.raises(InfeasibleError) as e:
        search(small_llama(), HW, Budgets(cpu_memory=GiB, gpu_memory=GiB), big)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("device memory: block inputs kept for backward"), msg
    assert "host memory: with block inputs in host RAM" in msg and "--tokens-per-step to ≤" in msg
    suggested = [int(n) for n in re.findall(r"--tokens-per-step to ≤ (\d+)", msg)]
    assert len(suggested) == 2 and suggested[0] != suggested[1]  # the device's figure and the host's own
    for n in suggested:  # each suggestion fits
        search(small_llama(), HW, Budgets(cpu_memory=GiB, gpu_memory=GiB), Request(seq_len=1024, tokens_per_step=n))


def test_clipping_under_a_small_host_budget_parks_gradients_on_ssd():
    """The default clipping needs no host RAM proportional to the model: with a budget below the
    parked gradients the plan parks the last blocks' on SSD, fits, and predicts the extra SSD traffic."""
    shape, req = small_llama(), Request(256, 2048, clip=True)
    roomy = search(shape, HW, Budgets(cpu_memory=8 * GiB, gpu_memory=GiB), req)
    assert roomy.plan.park_ram_blocks is None
    parks = sum(2 * b.numel for b in shape.blocks)
    smallest_chunks = host_buffers(
        shape, Plan(prefetch_depth=2, schedule="overlap_next_forward", state_chunk=1 << 20), StepConfig(1, 256)
    )
    tight_budget = smallest_chunks - parks // 2
    tight = search(shape, HW, Budgets(cpu_memory=tight_budget, gpu_memory=GiB), req)
    assert tight.plan.park_ram_blocks is not None and tight.plan.park_ram_blocks < len(shape.blocks)
    assert tight.prediction.memory.host <= tight_budget
    assert tight.prediction.ssd_write_bytes > roomy.prediction.ssd_write_bytes
    assert tight.prediction.ssd_read_bytes > roomy.prediction.ssd_read_bytes


@pytest.mark.slow  # ~15 s; the engine's split under a small device budget stays (test_moe_split)
def test_a_layer_too_big_for_the_device_is_split_into_expert_groups():
    """A Mixtral-8x22B-wide decoder layer (2.5 B params with its experts) needs 9.3 GiB for bf16
    weights and gradients: at 8 GiB its experts stream in groups (2 fit; more where predicted
    faster), the plan fits, and a group shares its layer's policy. Where not even one expert per
    block fits, the error names the block and its groups, and does not suggest a shorter sequence."""
    from fuyou.models.description import describe_model, load_description
    from fuyou.planner.search import _search_split
    from fuyou.schedule.shapes import NAMED

    shape = describe_model(NAMED["mixtral-8x22b"] | {"num_hidden_layers": 4}, "mixtral-8x22b, 4 layers")
    bud = Budgets(cpu_memory=128 * GiB, gpu_memory=8 * GiB)
    res = search(shape, HW, bud, REQ)
    g = res.plan.expert_groups
    assert g >= 2 and res.prediction.memory.device <= 8 * GiB
    pol = res.plan.activation_policy
    assert len(pol) == len(shape.split(g).blocks) == 2 + 4 * (1 + g)
    assert all(len(set(pol[b : b + 1 + g])) == 1 for b in range(1, len(pol) - 1, 1 + g))  # a layer's blocks alike
    if g > 2:  # more groups only where predicted faster (device memory shaped the 2-group plan)
        assert _search_split(shape.split(2), HW, bud, REQ).prediction.step_s > res.prediction.step_s
    with pytest.raises(InfeasibleError) as e:
        search(load_description("mixtral-8x22b"), HW, Budgets(cpu_memory=128 * GiB, gpu_memory=GiB), REQ)
    msg = str(e.value)
    assert (
        "block layer.0.experts.0 (an expert group, its layer's experts in 8 groups) (0.30 B params)" in msg
        and "--seq-len" not in msg
    ), msg


def test_expert_group_counts_stop_where_the_groups_set_no_floor(monkeypatch):
    """A Qwen3-235B-wide model (2 layers of 128 experts) whose LM head alone needs more host buffers
    than the budget: no expert-group count fits. The search stops at the first count whose groups
    neither are the largest block nor set the device peak (``_experts_bind``), not at one group per
    expert, and refuses with the message the walk over every count ends with."""
    from fuyou.models.description import describe_model
    from fuyou.planner import search as planner
    from fuyou.schedule.shapes import NAMED

    shape = describe_model(NAMED["qwen3-235b-a22b"] | {"num_hidden_layers": 2}, "qwen3-235b-a22b, 2 layers")
    bud, req = Budgets(cpu_memory=2 * GiB, gpu_memory=8 * GiB), Request(1024, 64 * 1024)
    tried: list[int] = []
    split = planner._search_split
    monkeypatch.setattr(planner, "_search_split", lambda s, *a: tried.append(s.expert_groups) or split(s, *a))
    with pytest.raises(InfeasibleError) as capped:
        search(shape, HW, bud, req)
    assert tried[-1] < 128 and "largest block" in str(capped.value)
    last = shape.split(tried[-1])
    assert not planner._experts_bind(last, HW, bud, req, smallest=True)
    monkeypatch.setattr(planner, "_experts_bind", lambda *a, **k: True)
    tried.clear()
    with pytest.raises(InfeasibleError) as every:
        search(shape, HW, bud, req)
    assert tried[-1] == 128 and str(every.value) == str(capped.value)


def test_split_layers_keep_their_routes_where_the_policy_says():
    """A split layer's route (one tokens × hidden tensor) stays on the device unless the layer's last
    expert group is ``recompute_cpu``; then it waits in host memory and its copies cost time."""
    from fuyou.models.description import load_description
    from fuyou.planner.cost import memory, predict

    shape = load_description("mixtral-8x7b").split(2)
    n, cfg = len(shape.blocks), StepConfig(1, 256, 2)
    tokens_bytes = 256 * shape.hidden * 2
    base = ["keep"] + ["recompute"] * (n - 2) + ["keep"]
    holder = shape.route_holders()[0]
    assert shape.blocks[holder].name == "layer.0.experts.1" and len(shape.route_holders()) == 32
    off = list(base)
    off[holder] = "recompute_cpu"
    on_device, on_host = (memory(shape, Plan(activation_policy=tuple(p)), cfg, HW) for p in (base, off))
    assert on_device.device - on_host.device == pytest.approx(tokens_bytes * (1 + ALLOWANCE), abs=1)
    assert on_host.host_activations - on_device.host_activations == tokens_bytes
    group = list(base)
    group[holder - 1] = "recompute_cpu"  # the first group holds nothing: no copy, no memory moved
    assert memory(shape, Plan(activation_policy=tuple(group)), cfg, HW) == on_device
    t = [predict(shape, Plan(activation_policy=tuple(p)), cfg, HW).busy_s.get("d2h", 0.0) for p in (base, off)]
    assert t[1] > t[0]


def test_a_frozen_base_plans_reads_only_and_fits_where_full_fine_tuning_does_not():
    """LoRA (``Request.lora_base``): no optimizer state on SSD or in host buffers, no SSD writes per
    step, a faster step; a host budget too small for full fine-tuning's buffers still plans."""
    bud = Budgets(cpu_memory=2 * GiB, gpu_memory=GiB)
    full = search(small_llama(), HW, bud, Request(256, 2048, clip=True, ram_tiers=False))
    lora = search(small_llama(), HW, bud, Request(256, 2048, clip=True, ram_tiers=False, lora_base=True))
    assert lora.plan.lora_base and not full.plan.lora_base and lora.plan.ram_state_blocks == 0
    assert lora.prediction.ssd_write_bytes == 0 < full.prediction.ssd_write_bytes
    assert lora.prediction.memory.ssd < full.prediction.memory.ssd / 5  # weights only: 2 B of 14 B per param
    assert lora.prediction.step_s < full.prediction.step_s
    tight = Budgets(cpu_memory=64 * MiB, gpu_memory=GiB)  # below even the vocabulary split's floor (92 MiB)
    with pytest.raises(InfeasibleError, match="host memory"):
        search(small_llama(), HW, tight, Request(256, 2048, clip=True, ram_tiers=False))
    assert search(
        small_llama(), HW, tight, Request(256, 2048, clip=True, lora_base=True, ram_tiers=False)
    ).plan.lora_base


def test_an_embedding_that_sets_the_host_floor_is_split_by_vocabulary_rows():
    """The small Llama's 32 k × 768 embedding and head are 4 decoder layers each: at a quarter of the
    unsplit buffers' host memory the planner splits both into 4 blocks of vocabulary rows, and the
    plan it returns fits; with room, it leaves them whole (the split costs a second head pass)."""
    bud = Budgets(cpu_memory=2 * GiB, gpu_memory=GiB)
    full = search(small_llama(), HW, bud, Request(256, 2048, clip=True, ram_tiers=False))
    assert full.plan.vocab_groups == 1
    need = host_buffers(small_llama(), full.plan, full.step)
    split = search(small_llama(), HW, Budgets(cpu_memory=need // 4, gpu_memory=GiB), Request(256, 2048, clip=True))
    assert split.plan.vocab_groups == 4 and split.prediction.memory.host <= need // 4
    assert split.prediction.step_s > full.prediction.step_s  # the head's second pass, smaller buffers


def test_blocks_frozen_whole_are_planned_without_state_or_writes():
    """``--freeze`` of the embedding and the lower half of Llama-3-8B: the store holds no state for
    them, a step writes and reads less from SSD, and model FLOPs drop their weight gradients."""
    from fuyou.models.description import load_description

    shape = load_description("llama-3-8b")
    frozen = load_description(
        "llama-3-8b", freeze=("model.embed_tokens.*", "model.layers.[0-9].*", "model.layers.1[0-5].*")
    )
    assert [b.name for b in frozen.blocks if b.frozen] == ["embed"] + [f"layer.{i}" for i in range(16)]
    assert frozen.params == shape.params
    cfg, plan = StepConfig(1, 1024, 2), Plan(activation_policy=("keep",) + ("recompute",) * 32 + ("keep",))
    from fuyou.planner.cost import memory, predict

    whole, part = (predict(s, plan, cfg, HW) for s in (shape, frozen))
    assert part.ssd_write_bytes < 0.6 * whole.ssd_write_bytes and part.ssd_read_bytes < whole.ssd_read_bytes
    state = 12 * sum(b.numel for b in frozen.blocks if b.frozen)
    assert memory(shape, plan, cfg, HW).ssd - memory(frozen, plan, cfg, HW).ssd == 2 * state
    assert frozen.train_flops_per_token(1024) < shape.train_flops_per_token(1024)


def test_frozen_parts_are_the_engine_layout_at_every_split():
    """The description freezes by the engine's own rule and layout at each expert-group count. Layer 0
    frozen: its core and every group frozen whole after a split; q_proj frozen: the core keeps exactly
    the layout's read-only part, the groups train whole."""
    from fuyou.models.adapters import make_adapter
    from fuyou.models.description import describe_model
    from fuyou.models.freeze import frozen_keys
    from fuyou.models.store_layout import ModelLayout
    from tests.integration.tiny_models import tiny

    cfg, _ = tiny("mixtral")
    moe = describe_model(cfg, freeze=("model.layers.0.*",)).split(2)
    assert [b.name for b in moe.blocks if b.frozen] == ["layer.0", "layer.0.experts.0", "layer.0.experts.1"]
    patterns = ("*.self_attn.q_proj.weight", "*.input_layernorm.weight")
    for groups in (1, 2):
        part = describe_model(cfg, freeze=patterns).split(groups)
        blocks = tuple(make_adapter(cfg, expert_groups=groups).blocks)
        lay = ModelLayout(blocks, frozen_params=frozen_keys(blocks, patterns))
        assert [b.name for b in part.blocks] == [b.name for b in blocks]
        for b, blk in enumerate(part.blocks):
            assert not blk.frozen and (blk.frozen_numel > 0) == (lay.f(b) is not None), blk.name
            assert (blk.numel, blk.frozen_numel) == (lay.numel(b), lay.frozen_numel(b)), blk.name
            assert 0 < blk.frozen_matmul_flops_per_token < blk.matmul_flops_per_token or not blk.frozen_numel


def test_frozen_parameters_in_training_blocks_are_planned_as_read_only():
    """q, k and v of every Llama-3-8B layer frozen: the store and the SSD writes lose their state and
    weights, the reads keep every weight, model FLOPs lose their weight gradients."""
    from fuyou.models.description import load_description
    from fuyou.planner.cost import memory, predict

    shape = load_description("llama-3-8b")
    part = load_description("llama-3-8b", freeze=("*.self_attn.[qkv]_proj.weight",))
    assert part.params == shape.params
    fz = sum(b.frozen_numel for b in part.blocks)
    assert fz == 32 * (4096 * 4096 + 2 * 1024 * 4096)  # q, k, v of each layer (GQA: 8 of 32 heads for k, v)
    cfg, plan = StepConfig(1, 1024, 2), Plan(activation_policy=("keep",) + ("recompute",) * 32 + ("keep",))
    whole, less = (predict(s, plan, cfg, HW) for s in (shape, part))
    assert whole.ssd_write_bytes - less.ssd_write_bytes == pytest.approx(fz * (2 + 12), rel=0.02)  # weights, state
    assert less.ssd_read_bytes < whole.ssd_read_bytes  # the state of the frozen part is not read back
    m0, m1 = memory(shape, plan, cfg, HW), memory(part, plan, cfg, HW)
    assert m0.ssd - m1.ssd == 2 * 12 * fz  # two versions of their state
    assert m1.device <= m0.device  # a layer's gradient is smaller (the head's working set is larger)
    assert part.train_flops_per_token(1024) < shape.train_flops_per_token(1024)
