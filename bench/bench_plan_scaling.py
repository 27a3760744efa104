"""Predicted data-parallel scaling (issue 17, item 6): the planner's step time for 1…8 ranks.

Pure prediction, no hardware: Llama-3-70B shape, seq 1024, a fixed global batch of 32 sequences
(32,768 tokens; 64 do not fit one rank's 74 GiB device with its 192 GiB host budget), clipping on (the CLI's default), on the hand-written per-rank profile
``bench/profiles/h100_rank.json`` (one H100 SXM, its eighth of a 2 TiB / 112-core server and one NVMe
drive), over PCIe 4.0 and over NVLink (``fuyou.planner.cluster.LINKS``: stated bus bandwidths).
Each rank's host budget is 3/4 of its RAM (``fuyou plan``'s default). Speed-up is the one-rank step
time ÷ N ranks' at the same global batch; efficiency is speed-up ÷ N.

    python bench/bench_plan_scaling.py          # prints the Markdown table
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fuyou.models.description import load_description  # noqa: E402
from fuyou.planner.cluster import LINKS, Cluster  # noqa: E402
from fuyou.planner.profile import load_profile  # noqa: E402
from fuyou.planner.result import Budgets, PlannerResult  # noqa: E402
from fuyou.planner.search import Request, search  # noqa: E402

PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles", "h100_rank.json")
MODEL, SEQ, SEQS = "llama-3-70b", 1024, 32


def plan(world: int, link: str) -> PlannerResult:
    """The planner's choice for ``world`` ranks on one node over ``link``."""
    prof = load_profile(PROFILE)
    bud = Budgets(cpu_memory=prof.host_memory_bytes * 3 // 4, gpu_memory=prof.device_memory_bytes)
    req = Request(seq_len=SEQ, tokens_per_step=SEQS * SEQ, clip=True, cluster=Cluster(world, 1, LINKS[link]))
    return search(load_description(MODEL), prof, bud, req)


def main() -> None:
    print(f"{MODEL}, seq {SEQ}, {SEQS} sequences per step (all ranks), clipping on, profile {PROFILE}\n")
    print(
        "| link | ranks | step s | speed-up | efficiency | bottleneck | SSD read+write GB/step per rank "
        "| collectives GB/step per rank | comm busy s | MFU |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for link in ("pcie4", "nvlink"):
        base = None
        for world in (1, 2, 4, 8):
            p = plan(world, link).prediction
            base = base or p.step_s
            ssd = (p.ssd_read_bytes + p.ssd_write_bytes) / 1e9
            comm = p.extra["resource_busy_s"].get("comm", 0.0)
            print(
                f"| {link} | {world} | {p.step_s:.1f} | {base / p.step_s:.2f} | {base / p.step_s / world:.0%} "
                f"| {p.bottleneck} | {ssd:.0f} | {p.comm_bytes / 1e9:.0f} | {comm:.1f} | {p.mfu:.0%} |"
            )


if __name__ == "__main__":
    main()
