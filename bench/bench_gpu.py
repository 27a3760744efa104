"""P6 — GPU throughput: a Llama-shaped model trained out of core; TFLOPS by the stated formula and MFU
against a bf16 matmul measured in the same run on the same GPU.

    python bench/bench_gpu.py --layers 32 --hidden 4096 --seq 2048 --micro-batch 4 --grad-accum 8 \\
        --ssd /scratch/fuyou --cpu-memory 100GiB          # Llama-7B shape (needs ~200 GB of store)
    python bench/bench_gpu.py --smoke                      # tiny, any device (what the tests run)
    python bench/bench_gpu.py --plan auto --profile hw.json ...   # the planner's plan: predicted ÷ measured

The model is random-init, built block by block (never whole in RAM). ``--plan fixed`` (default) runs
``--policy`` on every layer with no RAM tier; ``--plan auto`` lets the planner choose within
``--cpu-memory`` / ``--gpu-memory`` as ``fuyou finetune`` does (RAM tiers included) and records its
predicted step time beside the measured one (P7); ``--plan rules`` takes the engine's budget rules.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from bench.common import emit, hardware_info  # noqa: E402
from fuyou.engine import Engine, EngineConfig, Plan  # noqa: E402
from fuyou.planner.cost import FLOP_FORMULA  # noqa: E402
from fuyou.planner.shapes import shape_from_config  # noqa: E402


def matmul_peak(device: str, n: int, repeats: int = 10) -> float:
    """Achieved bf16 (GPU) or fp32 (CPU) matmul TFLOPS on ``device``: the MFU denominator."""
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    (a @ b).sum().item()
    t0 = time.perf_counter()
    for _ in range(repeats):
        c = a @ b
    sync()
    del c
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e12


class LazyInit(dict):
    """A state dict whose tensors are made on first access (seeded), so the model never sits in RAM."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.shapes = shapes

    def __getitem__(self, key: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(key) % (2**31))
        shape = self.shapes[key]
        if len(shape) == 1:
            return torch.ones(shape)
        return torch.randn(shape, generator=g) * 0.02


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ssd", default=None)
    ap.add_argument("--cpu-memory", default="64GiB")
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--policy", default="recompute", help="every layer's activation policy (--plan fixed)")
    ap.add_argument("--plan", choices=("fixed", "auto", "rules"), default="fixed")
    ap.add_argument("--profile", default=None, help="hardware profile for --plan auto (default: as fuyou finetune)")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.ffn, a.vocab, a.seq, a.micro_batch, a.grad_accum, a.steps = 2, 128, 256, 512, 64, 1, 2, 2
        a.cpu_memory = "512MiB"
    work = tempfile.mkdtemp(prefix="fuyou-bench-gpu-", dir=a.ssd or ("/work" if os.path.isdir("/work") else None))
    try:
        run(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def choose(a: argparse.Namespace, cfg: LlamaConfig, work: str, device: str) -> tuple[Plan, dict]:
    """The run's plan: ``--policy`` everywhere (``fixed``), or chosen as ``fuyou finetune`` chooses
    (``auto``: the planner, ``rules``); with the chooser's record (source, predicted step time, bottleneck)."""
    if a.plan == "fixed":
        return Plan(grad_accum=a.grad_accum, activation_policy=("keep",) + (a.policy,) * a.layers + ("keep",)), {}
    from fuyou.run.plan_choice import PlanRequest, choose_plan

    req = PlanRequest(
        model_config=cfg,
        store_dirs=(work,),
        cpu_memory=a.cpu_memory,
        gpu_memory=a.gpu_memory,
        device=device,
        precision="bf16",
        micro_batch_size=a.micro_batch,
        grad_accum=a.grad_accum,
        seq_len=a.seq,
        clip=True,
        mode=a.plan,
        profile=a.profile,
    )
    out = choose_plan(req, log=lambda msg: print(msg, file=sys.stderr))
    return out.plan, {
        k: v for k, v in out.info.items() if k in ("source", "profile", "predicted_step_s", "predicted_bottleneck")
    }


def run(a: argparse.Namespace, work: str) -> None:
    from transformers import LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=a.layers,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        vocab_size=a.vocab,
        num_attention_heads=max(1, a.hidden // 128),
        num_key_value_heads=max(1, a.hidden // 128),
        max_position_embeddings=a.seq,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    params = sum(torch.Size(s).numel() for s in shapes.values())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    peak = matmul_peak(device, 8192 if device == "cuda" else 1024)
    nb = a.layers + 2
    plan, chosen = choose(a, cfg, work, device)
    ec = EngineConfig(
        ssd_dirs=(work,),
        device=device,
        cpu_memory=a.cpu_memory,
        gpu_memory=a.gpu_memory,
        precision="bf16",
        lr=1e-5,
        max_grad_norm=1.0,
        plan=plan,
    )
    t0 = time.perf_counter()
    eng = Engine.from_state_dict(cfg, LazyInit(shapes), ec)
    import_s = time.perf_counter() - t0
    fpt = shape_from_config(cfg.to_dict()).train_flops_per_token(a.seq)
    ids = torch.randint(0, a.vocab, (a.micro_batch * a.grad_accum, a.seq))
    times, stats = [], None
    with eng:
        for i in range(a.steps + 1):
            eng.timeline.clear()
            stats = eng.train_step(ids)
            if i:
                times.append(stats["step_time_s"])
        if a.trace:
            eng.timeline.to_chrome_trace(a.trace)
    step = statistics.median(times)
    tflops = fpt * ids.numel() / step / 1e12
    emit(
        {
            "bench": "gpu_throughput",
            "smoke": a.smoke,
            "device": device,
            "params": params,
            "nblocks": nb,
            "tokens_per_step": ids.numel(),
            "step_s_median": step,
            "step_s_all": times,
            "tflops": tflops,
            "matmul_peak_tflops": peak,
            "mfu": tflops / peak,
            "flop_formula": FLOP_FORMULA,
            "import_s": import_s,
            "bottleneck": stats["bottleneck"],
            "plan": plan.to_json(),
            **chosen,
            **({"predicted_over_measured": chosen["predicted_step_s"] / step} if "predicted_step_s" in chosen else {}),
            "busy_frac": stats["busy_frac"],
            "cpu_memory": a.cpu_memory,
            "hardware": hardware_info([work]),
        },
        a.out,
    )


if __name__ == "__main__":
    main()
