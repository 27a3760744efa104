"""The planner on frontier shapes (issue 18): a feasible plan, or the binding constraint, for each of
GPT-3-175B, Llama-3.1-405B, Mixtral-8x7B, Mixtral-8x22B, Qwen3-235B-A22B, GPT-OSS-20B/120B, GLM-4.5-355B,
DeepSeek-V3-671B, Llama-4-Maverick, Qwen3.5-397B-A17B, MiniMax-M2, Mistral Small 4 and Qwen3-Next-80B-A3B on one stated
single-GPU box (``--profile``: also issue 33's two boxes, ``bench/profiles/box_4090_4nvme.json`` and
``box_h100_8nvme.json``).

Pure prediction, no hardware: the hand-written profile ``bench/profiles/lohan_4090.json`` (Fuyou/LoHan's
published testbed: one RTX 4090, 768 GB DDR4, 12 NVMe drives in RAID0), budgets as the README's
example (``--cpu-memory 700GiB --gpu-memory 22GiB``), seq 2048, 65,536 tokens per step, clipping on
(``fuyou finetune``'s default, ``--max-grad-norm 1``), bf16 compute with fp32 Adam state. The budgets and
the request are built by ``fuyou plan``'s own code (``fuyou.cli.plan_cmd.plan_inputs``): a row is what
``fuyou plan SHAPE --profile P --cpu-memory C --gpu-memory G --seq-len 2048 --tokens-per-step 65536
--max-grad-norm 1`` answers (``fuyou plan`` clips only when asked: without ``--max-grad-norm`` it plans
another run). Mixtures of experts count the FLOPs of the
tokens routed (``num_experts_per_tok`` experts per token) and of their shared experts; attention counts each
layer's heads (multi-head latent attention's wider ones) over its window (``BlockShape.attn_flops``).

    python bench/bench_frontier_plans.py        # JSON lines on stdout, the Markdown table on stderr
    python bench/bench_frontier_plans.py --gpu-memory 8GiB --shapes mixtral-8x22b,qwen3-235b-a22b
    python bench/bench_frontier_plans.py --profile bench/profiles/box_4090_4nvme.json --cpu-memory 240GiB
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit  # noqa: E402
from fuyou.cli.plan_cmd import plan_inputs  # noqa: E402
from fuyou.models.description import load_description  # noqa: E402
from fuyou.planner.profile import HardwareProfile, load_profile  # noqa: E402
from fuyou.planner.result import Budgets  # noqa: E402
from fuyou.planner.search import InfeasibleError, Request, search  # noqa: E402
from fuyou.run.config import FinetuneConfig  # noqa: E402
from fuyou.run.plan_choice import describe  # noqa: E402

PROFILE = os.path.join(ROOT, "bench", "profiles", "lohan_4090.json")
SHAPES = (
    "gpt3-175b",
    "llama-3.1-405b",
    "mixtral-8x7b",
    "mixtral-8x22b",
    "qwen3-235b-a22b",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "glm-4.5-355b",
    "deepseek-v3-671b",
    "llama-4-maverick",
    "qwen3.5-397b-a17b",
    "minimax-m2-230b",
    "mistral-small-4-119b",
    "qwen3-next-80b-a3b",
)
SEQ, TOKENS = 2048, 65536
CLIP = FinetuneConfig.max_grad_norm
"""Clipping threshold of the planned runs: ``fuyou finetune``'s default (on)."""


def inputs(prof: HardwareProfile, cpu_memory: str, gpu_memory: str) -> tuple[Budgets, Request]:
    """The budgets and request of every row on ``prof``: ``fuyou plan``'s (``plan_inputs``) for this bench's run."""
    return plan_inputs(
        prof,
        cpu_memory=cpu_memory,
        gpu_memory=gpu_memory,
        seq_len=SEQ,
        tokens_per_step=TOKENS,
        max_grad_norm=CLIP,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-memory", default="22GiB")
    ap.add_argument("--cpu-memory", default="700GiB")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--profile", default=PROFILE, help="a hardware profile (default: LoHan's 4090 testbed)")
    a = ap.parse_args()
    prof = load_profile(a.profile)
    bud, req = inputs(prof, a.cpu_memory, a.gpu_memory)
    rows = []
    for name in a.shapes.split(","):
        shape = load_description(name)
        params = sum(b.numel for b in shape.blocks)
        active = sum(b.matmul_flops_per_token for b in shape.blocks) // 2
        rec = {"bench": "frontier_plan", "shape": name, "params": params, "active_params": active, "gpu": a.gpu_memory}
        try:
            res = search(shape, prof, bud, req)
        except InfeasibleError as e:
            rec |= {"feasible": False, "binding": str(e)}
            rows.append(
                f"| {name} | {params / 1e9:.0f} B ({active / 1e9:.0f} B active) | — | — | — | — | — | — | — | {e} |"
            )
        else:
            p = res.prediction
            rec |= {
                "feasible": True,
                "plan": describe(res.plan),
                "step_s": p.step_s,
                "tflops": p.tflops,
                "mfu": p.mfu,
                "bottleneck": p.bottleneck,
                "ssd_read_write_gb": (p.ssd_read_bytes + p.ssd_write_bytes) / 1e9,
                "tokens_per_s": TOKENS / p.step_s,
                "host_gb": p.memory.host / 1e9,
                "ssd_store_gb": p.memory.ssd / 1e9,
            }
            rows.append(
                f"| {name} | {params / 1e9:.0f} B ({active / 1e9:.0f} B active) | {p.memory.host / 1e9:.0f} "
                f"| {p.memory.ssd / 1e12:.1f} | {p.step_s:.0f} | {TOKENS / p.step_s:.0f} | {p.tflops:.1f} "
                f"| {p.bottleneck} | {(p.ssd_read_bytes + p.ssd_write_bytes) / 1e12:.2f} | {describe(res.plan)} |"
            )
        emit(rec)
    print(
        f"profile {os.path.relpath(a.profile, ROOT)}, --cpu-memory {a.cpu_memory} --gpu-memory {a.gpu_memory}, seq {SEQ}, "
        f"{TOKENS} tokens per step, clipping on (--max-grad-norm {CLIP:g})\n\n"
        "| shape | parameters | host GB | SSD store TB | step s | tokens/s | TFLOPS | bottleneck "
        "| SSD TB read+written per step | plan, or the binding constraint |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows),
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
