"""Data-parallel steps in the cost model: per-rank shards, collectives on their own resource."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fuyou.cli.main import main
from fuyou.errors import ConfigError
from fuyou.models.description import load_description
from fuyou.planner.cluster import LINKS, Cluster, link_Bps
from fuyou.planner.cost import predict
from fuyou.planner.graph import StepConfig
from fuyou.planner.result import Budgets, PlannerResult
from fuyou.planner.search import Request, search
from fuyou.schedule import rules
from fuyou.schedule.plan import Plan
from fuyou.schedule.shards import collective_bytes
from tests.unit.planner.helpers import profile, small_llama

GIB = 1 << 30
SHAPE = load_description("gpt3-13b")
PROF = profile(device_peak_flops=165e12, ssd_read_Bps=25e9, ssd_write_Bps=20e9, adam_params_per_s=3e9)


def step(world: int, link: str = "pcie4") -> StepConfig:
    return StepConfig(1, 1024, cluster=Cluster(world, 1, LINKS[link]))


@pytest.mark.parametrize("sched", ["overlap_backward", "overlap_next_forward"])
def test_each_rank_moves_its_shards_and_gathers_every_load(sched):
    plan = Plan(grad_accum=4, prefetch_depth=2, schedule=sched, park_ram_blocks=0)
    one = predict(SHAPE, plan, step(1), PROF)
    four = predict(SHAPE, plan, step(4), PROF)
    assert one.comm_bytes == 0 and four.tokens == 4 * one.tokens
    for k in ("ssd_read_bytes", "ssd_write_bytes"):  # 1/4 of the bytes, up to the shards' 32-element rounding
        assert getattr(four, k) == pytest.approx(getattr(one, k) / 4, rel=1e-3)
    assert four.memory.ssd == pytest.approx(one.memory.ssd / 4, rel=1e-3)
    nb = len(SHAPE.blocks)
    tied = [i for i, b in enumerate(SHAPE.blocks) if b.name in SHAPE.blocks[-1].borrows]
    weightless = rules.weightless_backward([b.kind for b in SHAPE.blocks], plan)
    assert weightless == {0}  # the embedding's backward loads nothing: no gather
    loads = rules.load_order(nb, tied, 1, weightless)  # every upload all-gathered; every gradient reduce-scattered
    want = sum(collective_bytes(SHAPE.blocks[b].numel, 4, 2) for b in list(loads) + list(range(nb)))
    assert four.comm_bytes == want
    assert four.extra["resource_busy_s"]["comm"] > 0


def test_a_faster_link_is_never_slower_and_one_node_uses_its_own_link():
    plan = Plan(grad_accum=2, prefetch_depth=2)
    pcie, nvlink = (predict(SHAPE, plan, step(8, link), PROF).step_s for link in ("pcie4", "nvlink"))
    assert nvlink <= pcie
    assert Cluster(8, 1, LINKS["nvlink"]).bus_Bps == LINKS["nvlink"]
    assert Cluster(8, 2, LINKS["nvlink"], LINKS["ib200"]).bus_Bps == LINKS["ib200"]
    assert Cluster(1, 1).collective_s(1e9) == 0.0


def test_search_splits_the_global_batch_and_round_trips():
    req = Request(seq_len=128, tokens_per_step=1024, cluster=Cluster(2, 1))
    r = search(small_llama(), profile(device_peak_flops=1e12), Budgets(4 * GIB, GIB), req)
    assert r.plan.grad_accum * r.step.micro_batch_size == 4  # 8 sequences over 2 ranks
    assert r.prediction.tokens == 1024
    back = PlannerResult.from_json(json.loads(json.dumps(r.to_json())))
    assert back == r and back.step.cluster == Cluster(2, 1)
    with pytest.raises(ConfigError, match="do not split evenly over 3 ranks"):
        search(
            small_llama(),
            profile(device_peak_flops=1e12),
            Budgets(4 * GIB, GIB),
            Request(128, 1024, cluster=Cluster(3)),
        )


def test_link_names_and_numbers():
    assert link_Bps("NVLink", "--interconnect") == LINKS["nvlink"]
    assert link_Bps("50", "--interconnect") == 50e9
    with pytest.raises(ConfigError, match="--network must be one of"):
        link_Bps("fast", "--network")


def test_cli_plans_per_rank_with_the_node_ram_shared(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8}
    cfg |= {"num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prof = "bench/profiles/lohan_4090.json"
    cmd = ["plan", str(tmp_path / "config.json"), "--profile", prof, "--seq-len", "256"]
    r = CliRunner().invoke(main, [*cmd, "--gpus", "4", "--json", "-"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    host = json.load(open(prof))["host_memory_bytes"]
    assert d["budgets"]["cpu_memory"] == host * 3 // 4 // 4
    assert d["step"]["cluster"]["gpus_per_node"] == 4 and d["prediction"]["comm_bytes"] > 0
    printed = CliRunner().invoke(main, [*cmd, "--gpus", "2", "--nodes", "2", "--network", "12.5"])
    assert printed.exit_code == 0 and "2 per node × 2 nodes, bus 12 GB/s" in printed.output
    bad = CliRunner().invoke(main, [*cmd, "--gpus", "0"])
    assert bad.exit_code != 0 and "--gpus and --nodes must be ≥ 1" in bad.output
