"""The planner's answer: a frozen, JSON-serialisable result holding the ``Plan`` the engine runs.

``to_json``/``from_json`` round-trip exactly (tuples stay tuples). The ``Plan`` carries every choice
(the state chunk and RAM tiers included); ``step`` holds the batch shape and element sizes it was
predicted for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fuyou.planner.cluster import Cluster
from fuyou.planner.cost import Memory, Prediction
from fuyou.planner.graph import StepConfig
from fuyou.schedule.plan import Plan


@dataclass(frozen=True)
class Budgets:
    """What the plan must fit in, bytes."""

    cpu_memory: int
    """Host budget for Fuyou's buffers and swapped activations (``--cpu-memory``)."""
    gpu_memory: int
    """Device budget (``--gpu-memory``)."""
    ssd_bytes: int = 0
    """Free space for the store and its scratch files (activations, parked gradients); 0: not checked."""


@dataclass(frozen=True)
class PlannerResult:
    """A chosen plan (one the engine runs as it is) with its prediction."""

    model: str
    profile: str
    plan: Plan
    step: StepConfig
    prediction: Prediction
    budgets: Budgets
    considered: int = 0
    """Candidate plans the search evaluated."""

    def to_json(self) -> dict:
        """Plain data (inverse of ``from_json``)."""
        return {
            "model": self.model,
            "profile": self.profile,
            "plan": self.plan.to_json(),
            "step": dataclasses.asdict(self.step),
            "prediction": self.prediction.to_json(),
            "budgets": dataclasses.asdict(self.budgets),
            "considered": self.considered,
        }

    @staticmethod
    def from_json(d: dict) -> PlannerResult:
        """Rebuild a result written by ``to_json``."""
        plan = dict(d["plan"])
        if "micro_batches" in plan:  # results written before 0.2 named the accumulation count so
            plan["grad_accum"] = plan.pop("micro_batches")
        # before 0.2: a per-block policy and the device kind now; before 0.5: the state's bytes, now its format's
        gone = ("boundary_offload", "async_swap", "state_bytes_per_param")
        step = {k: v for k, v in d["step"].items() if k not in gone}
        for moved in ("state_chunk", "ram_weight_blocks", "ram_state_blocks"):  # results written before 0.2
            if moved in step:
                plan.setdefault(moved, step.pop(moved))
        step["cluster"] = Cluster(**step.get("cluster", {}))  # results written before 0.3: one rank
        pred = dict(d["prediction"])
        mem = {k: v for k, v in pred.pop("memory").items() if k != "host"}
        return PlannerResult(
            model=d["model"],
            profile=d["profile"],
            plan=Plan.from_json(plan),
            step=StepConfig(**step),
            prediction=Prediction(memory=Memory(**mem), **pred),
            budgets=Budgets(**d["budgets"]),
            considered=d.get("considered", 0),
        )
