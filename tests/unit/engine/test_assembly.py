"""Engine assembly (``fuyou.engine.assembly``): the plan the engine runs is decided once — a plan the
planner chose runs as it is, a front end's plan for the budget rules is completed (schedule, groups,
policies over every block, the host fit), and a resumed store runs the plan it recorded."""

from __future__ import annotations

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.models.description import describe_model
from fuyou.planner.result import Budgets
from fuyou.planner.search import Request, search
from tests.integration.tiny_models import batches, tiny
from tests.unit.planner.helpers import profile

MiB = 1 << 20


def _engine(tmp_path, plan: Plan, clip: float, cpu: int, gpu: int) -> Engine:
    cfg, model = tiny("qwen2", layers=3, hidden=64)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),), device="cpu", precision="fp32", plan=plan, max_grad_norm=clip, cpu_memory=cpu,
        gpu_memory=gpu,
    )  # fmt: skip
    return Engine.from_state_dict(cfg, sd, ec)


def test_a_plan_the_planner_chose_runs_as_it_is(tmp_path):
    cfg, _ = tiny("qwen2", layers=3, hidden=64)
    bud = Budgets(cpu_memory=64 * MiB, gpu_memory=256 * MiB)
    req = Request(seq_len=32, tokens_per_step=128, micro_batch_size=2, clip=True, precision="fp32")
    chosen = search(describe_model(cfg), profile(device="cpu"), bud, req).plan
    with _engine(tmp_path, chosen, 1.0, bud.cpu_memory, bud.gpu_memory) as eng:
        assert eng.plan == chosen


def test_the_rules_complete_a_plan_once_and_a_resumed_store_runs_the_one_it_recorded(tmp_path):
    with _engine(tmp_path, Plan(grad_accum=2), 1.0, 8 * MiB, 256 * MiB) as eng:
        plan = eng.plan
        eng.train_step(*batches(1, batch=2, seq=16)[0])
    assert plan.schedule == "overlap_next_forward" and plan.grad_accum == 2  # clipping chose the schedule
    assert (plan.expert_groups, plan.vocab_groups) == (1, 1)
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),), device="cpu", precision="fp32", plan=Plan(grad_accum=2), max_grad_norm=1.0,
        cpu_memory=8 * MiB, gpu_memory=256 * MiB,
    )  # fmt: skip
    with Engine.resume(ec) as again:
        assert again.plan == plan
