"""P6 — GPU throughput: a Llama-shaped model trained out of core; TFLOPS by the stated formula and MFU
against a bf16 matmul measured in the same run on the same GPU; beside it, plain PyTorch on the same
GPU (P6 a: Fuyou ÷ plain) and Fuyou again with blocks streamed from the store (P6 b).

    python bench/bench_gpu.py --layers 32 --hidden 4096 --seq 2048 --micro-batch 4 --grad-accum 8 \\
        --ssd /scratch/fuyou --cpu-memory 100GiB          # Llama-7B shape (needs ~200 GB of store)
    python bench/bench_gpu.py --mode side-by-side --layers 12 --hidden 2048 --ffn 5632 --vocab 32000 \\
        --seq 2048 --micro-batch 8 --grad-accum 4 --plan auto --ssd /scratch \\
        --ooc-gpu-memory 12GiB --ooc-cpu-memory 6GiB      # plain, Fuyou, Fuyou out of core; the ratios
    python bench/bench_gpu.py --smoke                      # tiny, any device (what the tests run)
    python bench/bench_gpu.py --plan auto --profile hw.json ...   # the planner's plan: predicted ÷ measured

Modes (``--mode``): ``fuyou`` (default) trains with the engine; ``plain`` trains the same model as a
plain Hugging Face model on the device (fp32 weights, bf16 autocast, ``torch.optim.AdamW(fused=True)``
where the device has it, the same batch, accumulation and clipping); ``side-by-side`` runs plain, then
Fuyou, then (with ``--ooc-cpu-memory``/``--ooc-gpu-memory``) Fuyou under those budgets, in one
process, and prints Fuyou ÷ plain. Every run: median step time after one warm-up step, tokens/s and
TFLOPS by the same formula (``fuyou.planner.cost.FLOP_FORMULA``), allocator figures.

Without CUDA the script stops with one line, unless ``--allow-cpu`` (or ``--smoke``) asks for the CPU
backend. Each result line is printed (flushed) and appended to ``--out`` as soon as it is measured,
before the engine and its store close: a disk that fills while the store is written back loses nothing.

The model is random-init, built block by block (never whole in RAM). ``--plan fixed`` (default) runs
``--policy`` on every layer with no RAM tier; ``--plan auto`` lets the planner choose within
``--cpu-memory`` / ``--gpu-memory`` as ``fuyou finetune`` does (RAM tiers included) and records its
predicted step time beside the measured one (P7); ``--plan rules`` takes the engine's budget rules.
``--torch-profile`` adds one step under ``torch.profiler``: its kernels' busy time beside the
timeline's device compute busy time for that step.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from bench.common import device_memory, emit, hardware_info  # noqa: E402
from fuyou.engine import Engine, EngineConfig, Plan  # noqa: E402
from fuyou.models.description import describe_model  # noqa: E402
from fuyou.planner.cost import FLOP_FORMULA  # noqa: E402
from fuyou.schedule.state_format import OFFERED  # noqa: E402

LR, CLIP = 1e-5, 1.0


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


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("fuyou", "plain", "side-by-side"), default="fuyou")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="measured steps (after one warm-up step)")
    ap.add_argument(
        "--ooc-steps", type=int, default=None, help="measured steps of the out-of-core run (default --steps)"
    )
    ap.add_argument("--ssd", default=None)
    ap.add_argument("--cpu-memory", default="64GiB")
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--ooc-cpu-memory", default=None, help="side-by-side: a third run, Fuyou under these budgets")
    ap.add_argument("--ooc-gpu-memory", default=None, help="side-by-side: a third run, Fuyou under these budgets")
    ap.add_argument("--policy", default="recompute", help="every layer's activation policy (--plan fixed)")
    ap.add_argument(
        "--also-fixed",
        default=None,
        help="side-by-side: one more Fuyou run, the chosen plan (its RAM tier, schedule, buffers) with this "
        "activation policy on every layer: what the planner's activation choice cost",
    )
    ap.add_argument(
        "--also-adam-threads",
        type=int,
        default=None,
        help="side-by-side: one more Fuyou run, the chosen plan with the CPU Adam on this many threads (default: "
        "all cores, which may starve the thread that launches the GPU's work)",
    )
    ap.add_argument("--adam-threads", type=int, default=None, help="the CPU Adam's threads (default: all cores)")
    ap.add_argument("--plan", choices=("fixed", "auto", "rules"), default="fixed")
    ap.add_argument("--profile", default=None, help="hardware profile for --plan auto (default: as fuyou finetune)")
    ap.add_argument("--trace", default=None, help="Chrome trace of the (first) Fuyou run's last step")
    ap.add_argument("--torch-profile", action="store_true", help="one more Fuyou step under torch.profiler")
    ap.add_argument(
        "--optimizer-state", choices=OFFERED, default="fp32", help="the Fuyou runs' state format on the store"
    )
    ap.add_argument("--label", default="fuyou", help="the Fuyou run's name in its line (``run``)")
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU backend where CUDA is not available")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device (implies --allow-cpu)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.smoke:
        a.layers, a.hidden, a.ffn, a.vocab, a.seq, a.micro_batch, a.grad_accum, a.steps = 2, 128, 256, 512, 64, 1, 2, 2
        a.cpu_memory = "512MiB"
        a.allow_cpu = True
    return a


def pick_device(a: argparse.Namespace) -> str:
    """``cuda`` where it is available; else ``cpu`` if ``--allow-cpu``, else exit with one line."""
    if torch.cuda.is_available():
        return "cuda"
    if a.allow_cpu:
        return "cpu"
    sys.exit(
        f"bench_gpu.py: CUDA is not available (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
        "this benchmark measures a GPU: pass --allow-cpu to run it on the CPU backend"
    )


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    device = pick_device(a)
    cfg = llama_config(a)
    peak = matmul_peak(device, 8192 if device == "cuda" else 1024)
    base = a.ssd or ("/work" if os.path.isdir("/work") else None)
    ctx = Context(a, cfg, device, peak, base)
    if a.mode == "plain":
        ctx.plain()
    elif a.mode == "fuyou":
        ctx.fuyou(a.label, a.cpu_memory, a.gpu_memory, a.steps, a.trace, profiled=a.torch_profile)
    else:
        side_by_side(ctx)


def side_by_side(ctx: Context) -> None:
    """Plain, then Fuyou, then (if asked) Fuyou out of core: each line and each ratio as it is measured.
    A run that fails leaves a line with its error and the next run still goes; the exit status is 1."""
    a = ctx.a
    failed = []
    plain = attempt(ctx, "plain", ctx.plain, failed)
    fy = attempt(
        ctx,
        a.label,
        lambda: ctx.fuyou(
            a.label,
            a.cpu_memory,
            a.gpu_memory,
            a.steps,
            a.trace,
            before_close=lambda r: plain and ctx.ratio(r, plain),
            profiled=a.torch_profile,
        ),
        failed,
    )
    variants = [(a.also_fixed, {"layer_policy": a.also_fixed})] if a.also_fixed else []
    if a.also_adam_threads:
        variants.append((f"adam{a.also_adam_threads}", {"adam_threads": a.also_adam_threads}))
    for suffix, overrides in variants:  # the same run with one thing changed, beside plain and the planned run
        alt = copy.copy(ctx)
        alt.a = argparse.Namespace(**{**vars(a), **overrides})
        label = f"{a.label}_{suffix}"
        attempt(
            alt,
            label,
            lambda alt=alt, label=label: alt.fuyou(
                label,
                a.cpu_memory,
                a.gpu_memory,
                a.steps,
                None,
                before_close=lambda r: [ctx.ratio(r, den) for den in (plain, fy) if den],
            ),
            failed,
        )
    if a.ooc_cpu_memory or a.ooc_gpu_memory:
        attempt(
            ctx,
            f"{a.label}_ooc",
            lambda: ctx.fuyou(
                f"{a.label}_ooc",
                a.ooc_cpu_memory or a.cpu_memory,
                a.ooc_gpu_memory or a.gpu_memory,
                a.ooc_steps or a.steps,
                None,
                before_close=lambda r: [ctx.ratio(r, den) for den in (plain, fy) if den],
            ),
            failed,
        )
    if failed:
        sys.exit(f"bench_gpu.py: side-by-side: {', '.join(failed)} failed (see the error lines)")


def attempt(ctx: Context, run: str, fn, failed: list[str]) -> dict[str, Any] | None:
    """``fn()``'s record; on an error, a line naming it (and None), the run's name added to ``failed``."""
    try:
        return fn()
    except Exception as e:
        traceback.print_exc()
        emit({"bench": "gpu_error", "run": run, "device": ctx.device, "error": f"{type(e).__name__}: {e}"}, ctx.a.out)
        failed.append(run)
        gc.collect()
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
        return None


def llama_config(a: argparse.Namespace) -> LlamaConfig:
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
    return cfg


def choose(
    a: argparse.Namespace, cfg: LlamaConfig, work: str, device: str, cpu_memory: str, gpu_memory: str | None
) -> tuple[Plan, dict]:
    """The run's plan: ``--policy`` everywhere (``fixed``), or chosen as ``fuyou finetune`` chooses
    (``auto``: the planner, ``rules``); with the chooser's record (source, predicted step time, bottleneck)."""
    plan, info = _choose(a, cfg, work, device, cpu_memory, gpu_memory)
    policy = getattr(a, "layer_policy", None)
    if policy is not None:  # the same plan, every layer (not the embedding or the head) under ``policy``
        acts = plan.activation_policy
        plan = dataclasses.replace(
            plan, activation_policy=tuple(p if i in (0, len(acts) - 1) else policy for i, p in enumerate(acts))
        )
        info = {k: v for k, v in info.items() if not k.startswith("predicted")} | {"layer_policy": policy}
    return plan, info


def _choose(
    a: argparse.Namespace, cfg: LlamaConfig, work: str, device: str, cpu_memory: str, gpu_memory: str | None
) -> tuple[Plan, dict]:
    if a.plan == "fixed":
        return Plan(grad_accum=a.grad_accum, activation_policy=("keep",) + (a.policy,) * a.layers + ("keep",)), {}
    from fuyou.run.plan_choice import PlanRequest, choose_plan

    req = PlanRequest(
        model_config=cfg,
        store_dirs=(work,),
        cpu_memory=cpu_memory,
        gpu_memory=gpu_memory,
        device=device,
        precision="bf16",
        micro_batch_size=a.micro_batch,
        grad_accum=a.grad_accum,
        seq_len=a.seq,
        clip=True,
        optimizer_state=a.optimizer_state,
        mode=a.plan,
        profile=a.profile,
        profile_out=None if a.profile else os.path.join(work, "profile.json"),
    )
    out = choose_plan(req, log=lambda msg: print(msg, file=sys.stderr))
    info = {k: v for k, v in out.info.items() if k in ("source", "profile", "predicted_step_s", "predicted_bottleneck")}
    if out.measured is not None:  # the quick profile itself, so the planner's choice can be replayed offline
        out.keep_profile()
        with open(out.info["profile"]) as f:
            info["measured_profile"] = json.load(f)
    return out.plan, info


class Context:
    """What every run of one invocation shares: the arguments, model config, device, matmul peak,
    the batch and the FLOP count per token."""

    def __init__(self, a: argparse.Namespace, cfg: LlamaConfig, device: str, peak: float, base: str | None) -> None:
        self.a, self.cfg, self.device, self.peak, self.base = a, cfg, device, peak, base
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            self.shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
        self.params = sum(torch.Size(s).numel() for s in self.shapes.values())
        self.fpt = describe_model(cfg).train_flops_per_token(a.seq)
        self.ids = torch.randint(
            0, a.vocab, (a.micro_batch * a.grad_accum, a.seq), generator=torch.Generator().manual_seed(0)
        )

    def figures(self, run: str, times: list[float]) -> dict[str, Any]:
        """The fields every run's line has, from its measured step times (same formula for all runs)."""
        step = statistics.median(times)
        tflops = self.fpt * self.ids.numel() / step / 1e12
        return {
            "run": run,
            "smoke": self.a.smoke,
            "device": self.device,
            "params": self.params,
            "nblocks": self.a.layers + 2,
            "seq": self.a.seq,
            "micro_batch": self.a.micro_batch,
            "grad_accum": self.a.grad_accum,
            "tokens_per_step": self.ids.numel(),
            "step_s_median": step,
            "step_s_all": times,
            "tokens_per_s": self.ids.numel() / step,
            "tflops": tflops,
            "matmul_peak_tflops": self.peak,
            "mfu": tflops / self.peak,
            "flop_formula": FLOP_FORMULA,
        }

    def plain(self) -> dict[str, Any]:
        """Plain PyTorch on the device: the HF model in fp32 with bf16 autocast, AdamW (fused where the
        device has it), the same batch, accumulation (loss over all labelled tokens) and clipping."""
        from transformers import LlamaForCausalLM

        a, dev = self.a, self.device
        before = device_memory(dev, reset=True)
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(dev):
            model = LlamaForCausalLM(self.cfg)
        model.train()
        try:
            opt, fused = torch.optim.AdamW(model.parameters(), lr=LR, fused=True), True
        except (RuntimeError, TypeError):  # no fused kernel for this device
            opt, fused = torch.optim.AdamW(model.parameters(), lr=LR), False
        build_s = time.perf_counter() - t0
        ids = self.ids.to(dev)
        micro = list(ids.chunk(a.grad_accum))
        n_items = sum(int(m[:, 1:].numel()) for m in micro)
        times, loss = [], float("nan")
        for i in range(a.steps + 1):
            sync(dev)
            t = time.perf_counter()
            total = torch.zeros((), device=dev)
            for m in micro:
                with torch.autocast(dev, dtype=torch.bfloat16):
                    out = model(input_ids=m, labels=m, num_items_in_batch=n_items)
                out.loss.backward()
                total += out.loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = total.item()  # synchronises
            sync(dev)
            if i:
                times.append(time.perf_counter() - t)
        rec = {
            "bench": "gpu_plain",
            **self.figures("plain", times),
            "optimizer": "torch.optim.AdamW(fused=True)" if fused else "torch.optim.AdamW (no fused kernel here)",
            "autocast": "bf16",
            "loss": loss,
            "build_s": build_s,
            "alloc": device_memory(dev, since=before),
            "hardware": hardware_info(),
        }
        emit(rec, a.out)
        del model, opt, out, total, ids, micro
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        return rec

    def fuyou(
        self,
        run: str,
        cpu_memory: str,
        gpu_memory: str | None,
        steps: int,
        trace: str | None,
        before_close=None,
        profiled: bool = False,
    ) -> dict[str, Any]:
        """Fuyou on a fresh store (its own directory, removed after close); the line is emitted, and
        ``before_close`` called with it, before the engine and its store close. ``profiled``: one more
        step under ``torch.profiler`` (``profile_step``) after the line."""
        work = tempfile.mkdtemp(prefix="fuyou-bench-gpu-", dir=self.base)
        try:
            return self._fuyou(work, run, cpu_memory, gpu_memory, steps, trace, before_close, profiled)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _fuyou(self, work, run, cpu_memory, gpu_memory, steps, trace, before_close, profiled) -> dict[str, Any]:
        a, dev = self.a, self.device
        plan, chosen = choose(a, self.cfg, work, dev, cpu_memory, gpu_memory)
        ec = EngineConfig(
            ssd_dirs=(work,),
            device=dev,
            cpu_memory=cpu_memory,
            gpu_memory=gpu_memory,
            precision="bf16",
            lr=LR,
            max_grad_norm=CLIP,
            optimizer_state=a.optimizer_state,
            adam_threads=a.adam_threads,
            plan=plan,
        )
        before = device_memory(dev, reset=True)
        t0 = time.perf_counter()
        eng = Engine.from_state_dict(self.cfg, LazyInit(self.shapes), ec)
        import_s = time.perf_counter() - t0
        times, stats = [], None
        try:
            for i in range(steps + 1):
                eng.timeline.clear()
                stats = eng.train_step(self.ids)
                if i:
                    times.append(stats["step_time_s"])
            assert stats is not None
            busiest = max(stats["busy_s"].values())
            m = eng.backend.memory()
            rec = {
                "bench": "gpu_throughput",
                **self.figures(run, times),
                "import_s": import_s,
                "bottleneck": stats["bottleneck"],
                "busy_s": stats["busy_s"],
                "busy_frac": stats["busy_frac"],
                "step_over_busiest": stats["step_time_s"] / busiest if busiest > 0 else None,
                "ssd_read_bytes": stats["ssd_read_bytes"],
                "ssd_write_bytes": stats["ssd_write_bytes"],
                "optimizer_state": a.optimizer_state,
                "adam_threads": a.adam_threads,
                "plan": plan.to_json(),
                **chosen,
                **(
                    {"predicted_over_measured": chosen["predicted_step_s"] / statistics.median(times)}
                    if "predicted_step_s" in chosen
                    else {}
                ),
                "cpu_memory": cpu_memory,
                "gpu_memory": gpu_memory,
                "backend_memory": {"peak": m.peak, "reserved": m.reserved, "capacity": m.capacity},
                "alloc": device_memory(dev, since=before),
                "hardware": hardware_info([work]),
            }
            emit(rec, a.out)
            if before_close is not None:
                before_close(rec)
            if profiled:
                profile_step(self, eng, run)
            if trace:
                eng.timeline.to_chrome_trace(trace)
        finally:  # the store is removed after this run: no write-back of the RAM tier (seconds, GBs of disk)
            eng.close(persist=False)
        return rec

    def ratio(self, num: dict[str, Any], den: dict[str, Any]) -> None:
        """One line: ``num``'s step time ÷ ``den``'s, and tokens/s the other way round (both ≥ 1 when
        ``num`` is slower)."""
        emit(
            {
                "bench": "gpu_ratio",
                "num": num["run"],
                "den": den["run"],
                "step_time_ratio": num["step_s_median"] / den["step_s_median"],
                "tokens_per_s_ratio": num["tokens_per_s"] / den["tokens_per_s"],
                "tflops_ratio": num["tflops"] / den["tflops"],
                "device": self.device,
                "tokens_per_step": self.ids.numel(),
                "params": self.params,
            },
            self.a.out,
        )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_step(ctx: Context, eng: Engine, run: str) -> None:
    """One step under ``torch.profiler``: the union of its device kernels' intervals (memcpy and memset
    apart) beside the timeline's ``compute`` busy time for the same step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device == "cuda" else [])
    eng.timeline.clear()
    with profile(activities=acts) as prof:
        stats = eng.train_step(ctx.ids)
    try:
        kernels, copies, error = *profiler_device_busy(prof), None
    except Exception as e:  # the profiler's event API moves between torch versions: keep the step's figures
        kernels, copies, error = 0.0, 0.0, f"{type(e).__name__}: {e}"
    compute = stats["busy_s"]["compute"]
    emit(
        {
            "bench": "gpu_profile_check",
            "run": run,
            "device": ctx.device,
            "step_s": stats["step_time_s"],
            "timeline_compute_busy_s": compute,
            "timeline_busy_s": stats["busy_s"],
            "profiler_kernel_busy_s": kernels,
            "profiler_memcpy_busy_s": copies,
            "timeline_over_profiler": compute / kernels if kernels else None,
            **({"profiler_error": error} if error else {}),
        },
        ctx.a.out,
    )


def profiler_device_busy(prof) -> tuple[float, float]:
    """(kernel busy s, memcpy/memset busy s): unions of the device events' intervals."""
    from torch.autograd import DeviceType

    from fuyou.timeline import union_length

    kern, cp = [], []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        iv = (e.time_range.start / 1e6, e.time_range.end / 1e6)
        (cp if e.name.startswith(("Memcpy", "Memset")) else kern).append(iv)
    return union_length(kern), union_length(cp)


if __name__ == "__main__":
    main()
