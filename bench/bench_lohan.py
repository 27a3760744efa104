"""Planner sanity check against LoHan's published curve (issue 6): pure prediction, no hardware.

Hand-written profile ``bench/profiles/lohan_4090.json`` (RTX 4090, PCIe 4.0, 12 SSDs, 768 GB RAM),
GPT-3-13B shape, seq 1024, batch 8…128 sequences. Two columns per batch: the SSD-resident plan
(``ram_tiers`` off, as Fuyou/LoHan keep state on SSD; block inputs in host RAM where the 22 GiB
device cannot hold them: ``recompute_cpu``), and the plan with RAM tiers allowed (700 GiB host
budget: all weights and state fit in RAM).

    python bench/bench_lohan.py            # prints the Markdown table
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fuyou.models.description import load_description  # noqa: E402
from fuyou.planner.profile import load_profile  # noqa: E402
from fuyou.planner.result import Budgets  # noqa: E402
from fuyou.planner.search import InfeasibleError, Request, search  # noqa: E402

LOHAN_TFLOPS = {8: 42.8, 16: 84.3, 32: 143.1, 64: 155.8, 128: 153.8}
PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles", "lohan_4090.json")


def cell(shape: object, prof: object, batch: int, **req: object) -> tuple[str, dict | None]:
    """One table cell: 'step s / TFLOPS / bottleneck (micro-batch; policies; RAM tiers)'."""
    try:
        r = search(
            shape,
            prof,
            Budgets(cpu_memory=700 << 30, gpu_memory=22 << 30),
            Request(seq_len=1024, tokens_per_step=batch * 1024, **req),
        )
    except InfeasibleError as e:
        return "infeasible (" + str(e).split(":")[0] + ")", None
    p, plan = r.prediction, r.plan
    pols = plan.activation_policy[1:-1]
    mix = ", ".join(
        f"{k} {pols.count(k)}" for k in ("keep", "swap_cpu", "swap_ssd", "recompute", "recompute_cpu") if pols.count(k)
    )
    ram = f"; RAM w {plan.ram_weight_blocks}/s {plan.ram_state_blocks}" if plan.ram_weight_blocks else ""
    mb = r.step.micro_batch_size
    return (
        f"{p.step_s:.1f} s / **{p.tflops:.0f}** / {p.bottleneck} (mb {mb}×{batch // mb}; {mix}{ram}; "
        f"{plan.schedule.split('_')[1]})"
    ), r.to_json()


def main() -> None:
    shape, prof = load_description("GPT-3-13B"), load_profile(PROFILE)
    print("| batch | LoHan TFLOPS | SSD-resident | + RAM tiers (700 GiB) |")
    print("|---|---|---|---|")
    for batch in (8, 16, 32, 48, 64, 128):
        cols = [
            cell(shape, prof, batch, ram_tiers=False),
            cell(shape, prof, batch, ram_tiers=True),
        ]
        print(f"| {batch} | {LOHAN_TFLOPS.get(batch, '—')} | " + " | ".join(c for c, _ in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
