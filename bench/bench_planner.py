"""P7 — planner accuracy: predicted ÷ measured step time for several plans, side by side in one run.

For each setting the machine is profiled first with the planner's own measurement functions (SSD
read/write of the store directory, CPU Adam at the setting's thread count, memcpy, and the
setting's layer and head forward/backward at its micro-batch × sequence length, gradient
accumulation and norm rates), then the real
engine (``Engine.from_state_dict`` on a random-init Llama) runs ``--warmup`` + ``--repeats`` steps;
the figure is the cost model's step time ÷ the median measured step time. Settings span SSD-bound
(few tokens, wide layers; and 1024 tokens with keep / recompute / swap_cpu), compute-bound (4096
tokens, keep / recompute) and Adam-bound (a 0.6 B-parameter model, mostly embedding and LM head,
8 tokens, one Adam thread, every block's weights and state in the RAM tier: no SSD traffic). For the settings whose plan is the engine's default rules (``ssd``,
``recompute``: every layer recomputed, prefetch depth 2) the planner's own plans for the same model,
batch and budgets (state on SSD only; RAM tiers allowed) run too: three engines, steps taken
round-robin with the order rotating each round, speed-up = median rules step ÷ median planner step
(and the median of per-round ratios).

    python bench/bench_planner.py                      # full run (several minutes)
    python bench/bench_planner.py --only ssd,keep      # some settings
    python bench/bench_planner.py --smoke              # seconds; what the tests run
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_engine import build_model, llama_config, make_batch  # noqa: E402
from bench.common import emit, hardware_info  # noqa: E402
from fuyou.device import get_backend  # noqa: E402
from fuyou.engine import Engine, EngineConfig, Plan  # noqa: E402
from fuyou.models.description import describe_model  # noqa: E402
from fuyou.planner import measure  # noqa: E402
from fuyou.planner.cost import predict  # noqa: E402
from fuyou.planner.graph import StepConfig  # noqa: E402
from fuyou.planner.profile import HardwareProfile  # noqa: E402
from fuyou.planner.result import Budgets  # noqa: E402
from fuyou.planner.search import Request, search  # noqa: E402
from fuyou.units import parse_size  # noqa: E402

# name: (model shape, batch, seq, policy, adam threads (0 = all), every block's weights and state in the RAM tier)
MODELS = {
    "wide": dict(hidden=1536, layers=4, inter=4096, heads=12, kv_heads=4, vocab=32000),
    "p2": dict(hidden=1024, layers=8, inter=2816, heads=16, kv_heads=4, vocab=32000),
    "bigvocab": dict(hidden=2048, layers=2, inter=5632, heads=16, kv_heads=4, vocab=128000),
    "smoke": dict(hidden=64, layers=2, inter=128, heads=4, kv_heads=2, vocab=96),
}
SETTINGS = {
    "ssd": ("wide", 1, 32, "recompute", 0, False),
    "keep": ("p2", 4, 256, "keep", 0, False),
    "recompute": ("p2", 4, 256, "recompute", 0, False),
    "swap_cpu": ("p2", 4, 256, "swap_cpu", 0, False),
    "compute": ("p2", 16, 256, "keep", 0, False),
    "compute_rc": ("p2", 16, 256, "recompute", 0, False),
    "adam": ("bigvocab", 1, 8, "recompute", 1, True),
    "smoke": ("smoke", 2, 16, "recompute", 0, False),
}


def profile_for(cfg: object, store_dir: str, mb: int, seq: int, threads: int, a: argparse.Namespace) -> HardwareProfile:
    """The planner's measurements for one setting (see the module docstring)."""
    backend = get_backend("cpu")
    n = a.profile_repeats
    r, w, io_cpu = measure.ssd_measure([store_dir], a.ssd_mib << 20, repeats=n)
    mem = measure.host_memcpy(64 << 20, n)
    shape = describe_model(cfg)
    H = len(shape.blocks) - 1
    pt, act = measure.block_compute(cfg, backend, 1, mb, seq, shape.blocks[1].fwd_flops_per_token(shape.hidden, seq), n)
    hp, _ = measure.block_compute(cfg, backend, H, mb, seq, shape.blocks[H].fwd_flops_per_token(shape.hidden, seq), n)
    adam = measure.adam_throughput(8 << 20 if a.smoke else 32 << 20, n, threads=threads or os.cpu_count())
    add, norm = measure.device_elementwise(backend, 4 << 20 if a.smoke else 64 << 20, n)
    return HardwareProfile(
        ssd_read_Bps=r,
        ssd_write_Bps=w,
        adam_params_per_s=adam,
        name="bench",
        device="cpu",
        compute=(pt,),
        head_compute=(hp,),
        h2d_Bps=mem,
        d2h_Bps=mem,
        host_mem_Bps=mem,
        device_mem_Bps=mem,
        grad_add_elems_per_s=add,
        grad_norm_elems_per_s=norm,
        io_cpu_s_per_byte=io_cpu,
        layer_act_bytes_per_token=act,
        model_signature=shape.signature,
    )


def engine_config(store: str, plan: Plan, chunk: int | None, threads: int, a: argparse.Namespace) -> EngineConfig:
    """The benchmark's engine settings for ``plan`` (with ``chunk``, when given, as its state chunk)."""
    return EngineConfig(
        ssd_dirs=(store,),
        precision="bf16",
        lr=1e-4,
        weight_decay=0.01,
        cpu_memory=a.cpu_memory,
        plan=replace(plan, state_chunk=chunk) if chunk else plan,
        adam_threads=threads or None,
    )


def run_engine(
    cfg: object,
    sd: dict,
    store: str,
    plan: Plan,
    chunk: int | None,
    threads: int,
    ids: torch.Tensor,
    a: argparse.Namespace,
) -> tuple[float, list[float], Plan, int, dict]:
    """Median step time of the real engine running ``plan``: (median s, all, plan run, chunk, busy)."""
    eng = Engine.from_state_dict(cfg, sd, engine_config(store, plan, chunk, threads, a))
    try:
        times, busy = [], {}
        for rep in range(a.warmup + a.repeats):
            st = eng.train_step(ids)
            if rep >= a.warmup:
                times.append(st["step_time_s"])
                busy = st["busy_s"]
        return statistics.median(times), times, eng.plan, eng.layout.state_chunk, busy
    finally:
        eng.close()


def run_interleaved(
    cfg: object,
    sd: dict,
    work: str,
    specs: list[tuple[Plan, int | None]],
    threads: int,
    ids: torch.Tensor,
    a: argparse.Namespace,
) -> list[list[float]]:
    """Step times of several plans run side by side: one engine per plan (own store directory), steps
    taken round-robin, the order rotating every round, so machine drift and position hit all alike;
    ``--warmup`` rounds dropped."""
    engines = []
    try:
        for i, (plan, chunk) in enumerate(specs):
            d = os.path.join(work, f"cmp{i}")
            os.makedirs(d)
            ec = engine_config(d, plan, chunk, threads, a)
            engines.append(Engine.from_state_dict(cfg, sd, ec))
        times: list[list[float]] = [[] for _ in specs]
        n = len(engines)
        for rep in range(a.warmup + a.repeats):
            for i in [(rep + k) % n for k in range(n)]:  # the order rotates: no plan always goes first
                st = engines[i].train_step(ids)
                if rep >= a.warmup:
                    times[i].append(st["step_time_s"])
        return times
    finally:
        for eng in engines:
            eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only", default="ssd,keep,recompute,swap_cpu,compute,compute_rc,adam", help="comma list of settings"
    )
    ap.add_argument("--dir", default=None, help="store parent directory (default: a temp dir in /work)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ssd-mib", type=int, default=512)
    ap.add_argument("--profile-repeats", type=int, default=5, help="repeats of each profile measurement (median)")
    ap.add_argument("--cpu-memory", default="16GiB")
    ap.add_argument("--no-compare", action="store_true", help="skip the planner-vs-default-rules pair")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.smoke:
        a.only, a.repeats, a.warmup, a.ssd_mib, a.profile_repeats, a.no_compare = "smoke", 1, 1, 16, 1, False
    base = a.dir or ("/work" if os.path.isdir("/work") else tempfile.gettempdir())
    hw = hardware_info([base])
    for name in a.only.split(","):
        model, batch, seq, policy, threads, ram = SETTINGS[name]
        work = tempfile.mkdtemp(prefix="fuyou-bench-planner-", dir=base)
        try:
            setting(name, model, batch, seq, policy, threads, ram, work, a, hw)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def setting(
    name: str,
    model: str,
    batch: int,
    seq: int,
    policy: str,
    threads: int,
    ram: bool,
    work: str,
    a: argparse.Namespace,
    hw: dict,
) -> None:
    m = MODELS[model]
    cfg = llama_config(m["hidden"], m["layers"], m["inter"], m["heads"], m["kv_heads"], m["vocab"], seq)
    sd = {k: v.detach().clone() for k, v in build_model(cfg).state_dict().items()}
    ids = make_batch(m["vocab"], batch, seq)
    prof = profile_for(cfg, work, batch, seq, threads, a)
    shape = describe_model(cfg)
    nb = len(shape.blocks)
    plan = Plan(
        grad_accum=1,
        prefetch_depth=2,
        activation_policy=("keep",) + (policy,) * (nb - 2) + ("keep",),
        ram_weight_blocks=nb if ram else 0,
        ram_state_blocks=nb if ram else 0,
    )
    meas, all_t, ran, chunk, busy = run_engine(cfg, sd, work, plan, None, threads, ids, a)
    pred = predict(shape, ran, StepConfig(batch, seq), prof)
    emit(
        {
            "bench": "planner_p7",
            "setting": name,
            "model": {**m, "params": shape.params, "batch": batch, "seq": seq},
            "plan": ran.to_json(),
            "state_chunk": chunk,
            "adam_threads": threads or "all",
            "predicted_s": pred.step_s,
            "measured_s": meas,
            "ratio": pred.step_s / meas,
            "met": abs(pred.step_s / meas - 1) <= 0.15,
            "measured_all_s": all_t,
            "predicted_bottleneck": pred.bottleneck,
            "predicted_busy_s": pred.busy_s,
            "measured_busy_s": busy,
            "profile": prof.to_json(),
            "smoke": a.smoke,
            "hardware": hw,
        },
        a.out,
    )
    if a.no_compare or name not in ("ssd", "recompute", "smoke"):  # settings whose plan is the default rules
        return
    prof = replace(prof, device_memory_bytes=4 << 30)
    budgets = Budgets(cpu_memory=parse_size(a.cpu_memory), gpu_memory=prof.device_memory_bytes)
    res = {
        tiers: search(
            shape,
            prof,
            budgets,
            Request(seq_len=seq, tokens_per_step=batch * seq, micro_batch_size=batch, ram_tiers=tiers),
        )
        for tiers in (False, True)
    }  # the planner with state on SSD only, then allowed RAM tiers
    specs = [(ran, chunk)] + [(r.plan, r.plan.state_chunk) for r in res.values()]
    rules_t, *planner_t = run_interleaved(cfg, sd, work, specs, threads, ids, a)
    for (tiers, r), p_t in zip(res.items(), planner_t):
        pairs = [x / y for x, y in zip(rules_t, p_t)]
        emit(
            {
                "bench": "planner_vs_rules",
                "setting": name,
                "ram_tiers": tiers,
                "rules_plan": ran.to_json(),
                "rules_chunk": chunk,
                "planner_plan": r.plan.to_json(),
                "planner_chunk": r.plan.state_chunk,
                "rules_measured_s": statistics.median(rules_t),
                "planner_measured_s": statistics.median(p_t),
                "speedup": statistics.median(rules_t) / statistics.median(p_t),
                "speedup_pair_median": statistics.median(pairs),
                "planner_predicted_s": r.prediction.step_s,
                "rules_predicted_s": pred.step_s,
                "rules_measured_all_s": rules_t,
                "planner_measured_all_s": p_t,
                "cpu_memory": a.cpu_memory,
                "method": "interleaved: rules, planner (SSD only), planner (RAM tiers) round-robin, order rotating each round",
                "smoke": a.smoke,
                "hardware": hw,
            },
            a.out,
        )


if __name__ == "__main__":
    main()
