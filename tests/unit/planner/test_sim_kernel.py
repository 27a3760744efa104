"""The simulation's compiled fast path (``sim_kernel``) equals the plain loop (``Sim.run_reference``) bit for bit."""

from __future__ import annotations

import os
import random

import pytest

from fuyou.planner.sim import Sim

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def random_sim(seed: int, n: int) -> Sim:
    """A random dependency graph over merged and plain resources and synchronisation points, with durations
    that tie (0, 0.5, 1) as often as not, repeated dependencies and None among them."""
    rng = random.Random(seed)
    sim = Sim({"adam": "cpu", "compute": "cpu"})
    for i in range(n):
        deps: list[int | None] = [rng.randrange(i) for _ in range(rng.randint(0, min(i, 6)))] if i else []
        if deps and rng.random() < 0.2:
            deps.append(deps[0])
        if rng.random() < 0.1:
            deps.append(None)
        sim.op(
            rng.choice([None, "ssd", "adam", "compute", "d2h", "h2d"]), rng.choice([0.0, 0.5, 1.0, rng.random()]), deps
        )
    return sim


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_simulation_equals_the_reference(seed: int) -> None:
    sim = random_sim(seed, 2000)
    assert sim.run() == sim.run_reference()


def test_edge_cases_equal_the_reference() -> None:
    empty = Sim()
    assert empty.run() == empty.run_reference() == []
    only_sync = Sim()
    a = only_sync.op(None, 0.0)
    only_sync.op(None, 0.0, (a, a))
    assert only_sync.run() == only_sync.run_reference() == [0.0, 0.0]
    one = Sim()
    x = one.op("ssd", 2.0)
    y = one.op("ssd", 1.0)  # waits for the server, not for x
    one.op("cpu", 0.5, (x, y))
    assert one.run() == one.run_reference() == [2.0, 3.0, 3.5]


def test_a_planners_prediction_is_the_same_through_either(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole step graph (GPT-3-13B, the clipping schedule, state chunk by chunk) predicts the same."""
    from fuyou.models.description import load_description
    from fuyou.planner.cluster import Cluster
    from fuyou.planner.cost import predict
    from fuyou.planner.graph import StepConfig
    from fuyou.planner.profile import load_profile
    from fuyou.schedule.plan import Plan

    shape, prof = load_description("gpt3-13b"), load_profile(os.path.join(ROOT, "bench/profiles/box_4090_4nvme.json"))
    plan = Plan(grad_accum=2, schedule="overlap_next_forward", state_chunk=1 << 22)
    cfg = StepConfig(1, 1024, 2, Cluster(1), optimizer_state="int8")
    fast = predict(shape, plan, cfg, prof)
    monkeypatch.setattr(Sim, "run", Sim.run_reference)
    assert fast.step_s > 0 and predict(shape, plan, cfg, prof) == fast
