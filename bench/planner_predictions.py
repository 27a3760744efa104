"""The planner's predictions on ``bench_planner.py``'s settings, with fixed profiles, as JSON: what a
refactor of the planner or the step's rules must leave bit-identical (or explain).

For each setting (model, batch, sequence, activation policy, RAM tier) and two fixed profiles (a
hand-written 2-core CPU one and ``bench/profiles/lohan_4090.json``): ``cost.predict`` of the setting's
plan under both schedules, and ``search.search`` for host budgets 16 GiB / 1 GiB / 300 MiB × clipping
on/off × bf16/fp32 × RAM tiers on/off (device budget 4 GiB). Floats are written exactly (``repr``).

    python bench/planner_predictions.py --out before.json          # ~3 minutes on 2 cores
    python bench/planner_predictions.py --out after.json --compare before.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.bench_engine import llama_config  # noqa: E402
from bench.bench_planner import MODELS, SETTINGS  # noqa: E402
from fuyou.models.description import describe_model  # noqa: E402
from fuyou.planner.cost import predict  # noqa: E402
from fuyou.planner.graph import StepConfig  # noqa: E402
from fuyou.planner.profile import ComputePoint, HardwareProfile, load_profile  # noqa: E402
from fuyou.planner.result import Budgets  # noqa: E402
from fuyou.planner.search import Request, search  # noqa: E402
from fuyou.schedule.plan import Plan  # noqa: E402
from fuyou.units import parse_size  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_profile() -> HardwareProfile:
    """A fixed 2-core CPU profile (numbers of the order this machine measures)."""
    return HardwareProfile(
        ssd_read_Bps=1.5e9, ssd_write_Bps=0.9e9, adam_params_per_s=3e8, name="cpu", device="cpu",
        compute=(ComputePoint(64, 5e10, 4e10),), head_compute=(ComputePoint(64, 4e10, 3e10),),
        h2d_Bps=8e9, d2h_Bps=8e9, host_mem_Bps=8e9, device_mem_Bps=8e9, grad_add_elems_per_s=1e9,
        grad_norm_elems_per_s=2e9, io_cpu_s_per_byte=2e-10,  # CPU-s per byte (not ÷ cores since s3)
    )  # fmt: skip


def predictions() -> dict:
    """Every prediction and search result, keyed ``setting/profile/...``."""
    profs = {"cpu": cpu_profile(), "4090": load_profile(os.path.join(HERE, "profiles", "lohan_4090.json"))}
    out: dict = {}
    for name, (model, batch, seq, policy, _threads, ram) in SETTINGS.items():
        m = MODELS[model]
        cfg = llama_config(m["hidden"], m["layers"], m["inter"], m["heads"], m["kv_heads"], m["vocab"], seq)
        shape = describe_model(cfg)
        nb = len(shape.blocks)
        for pn, prof in profs.items():
            for sched in ("overlap_backward", "overlap_next_forward"):
                pol = ("keep",) + (policy,) * (nb - 2) + ("keep",)
                plan = Plan(grad_accum=1, prefetch_depth=2, activation_policy=pol, schedule=sched,
                            ram_weight_blocks=nb if ram else 0, ram_state_blocks=nb if ram else 0)  # fmt: skip
                out[f"{name}/{pn}/{sched}/predict"] = predict(shape, plan, StepConfig(batch, seq), prof).to_json()
            for cpu in ("16GiB", "1GiB", "300MiB"):
                for clip in (False, True):
                    for prec in ("bf16", "fp32"):
                        for tiers in (False, True):
                            out[f"{name}/{pn}/{cpu}/clip{clip}/{prec}/tiers{tiers}"] = _search(
                                shape, prof, parse_size(cpu), Request(seq_len=seq, tokens_per_step=batch * seq,
                                                                      clip=clip, ram_tiers=tiers, precision=prec))  # fmt: skip
    return out


def _search(shape: object, prof: HardwareProfile, cpu: int, req: Request) -> object:
    pr = dataclasses.replace(prof, device_memory_bytes=4 << 30)
    try:
        r = search(shape, pr, Budgets(cpu_memory=cpu, gpu_memory=pr.device_memory_bytes), req)  # type: ignore[arg-type]
    except Exception as e:  # a refusal is a result too
        return f"{type(e).__name__}: {e}"
    return {"plan": r.plan.to_json(), "step": dataclasses.asdict(r.step), "pred": r.prediction.to_json(),
            "n": r.considered}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="an earlier --out file: list the keys whose value differs")
    a = ap.parse_args()
    now = predictions()
    with open(a.out, "w") as f:
        json.dump(now, f, indent=1, sort_keys=True, default=repr)
    if a.compare:
        with open(a.compare) as f:
            old = json.load(f)
        now = json.loads(json.dumps(now, default=repr))
        diff = sorted(k for k in old.keys() | now.keys() if old.get(k) != now.get(k))
        print(f"{len(now)} results, {len(diff)} differ" + "".join(f"\n  {k}" for k in diff))


if __name__ == "__main__":
    main()
