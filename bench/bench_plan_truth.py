"""P7 through the CLI — the planner's predicted step time ÷ the measured one, for settings chosen before measuring.

Each setting is one real ``fuyou finetune`` run with the CLI's defaults (planner on, clipping on, precision
auto) except what the setting names, on a real model (default: SmolLM2-135M-Instruct, the demo's) and the
demo's text, with a fresh per-machine cache for the whole bench: the first run measures the quick hardware
profile, the others reuse it, as a user's runs on one machine would. Figure per setting: the plan's
``predicted_step_s`` (``run.json``) ÷ the median ``step_time_s`` of the steps after ``--warmup``
(``metrics.jsonl``); the run's own verdict on the cached profile (``profile_check`` in run.json) is
reported beside it.

    python bench/bench_plan_truth.py                       # every setting (~5 minutes on 2 cores)
    python bench/bench_plan_truth.py --only lora,freeze    # some
    python bench/bench_plan_truth.py --smoke               # a tiny random model, two settings (the test)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, hardware_info  # noqa: E402

SEQ = 256
SETTINGS: dict[str, list[str]] = {
    # name: the CLI flags beside the defaults (chosen before measuring; not tuned to the results)
    "ssd_noclip_fp32": ["--max-grad-norm", "0", "--precision", "fp32", "--cpu-memory", "1GiB"],
    "clip_accum_fp32": ["--grad-accum", "2", "--precision", "fp32", "--cpu-memory", "1GiB"],
    "ram_tier_auto": ["--cpu-memory", "8GiB"],
    "ssd_auto": ["--cpu-memory", "1GiB"],
    "lora8": ["--lora-rank", "8", "--cpu-memory", "1GiB"],
    "freeze_lower": ["--freeze", "model.embed_tokens.*", "--freeze", "model.layers.[0-9].*", "--cpu-memory", "1GiB"],
    "moe_ssd": ["--cpu-memory", "1GiB"],
}
MOE = {"moe_ssd"}
"""Settings run on the random-init mixture of experts (``moe_model``) instead of the real model."""


def moe_model(out: str) -> str:
    """A random-init Mixtral (8 experts, 2 routed; hidden 256, 4 layers) saved with the real model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    from fuyou.run.demo import demo_model_dir

    real, _ = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(real)
    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048,
    )  # fmt: skip
    MixtralForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_setting(name: str, flags: list[str], model: str, data: str, work: str, steps: int, warmup: int) -> dict:
    """One ``fuyou finetune`` run; its predicted and measured step times."""
    out = os.path.join(work, name)
    os.sync()  # the last run's store writes, still in the page cache, would be written back during this one
    cmd = [sys.executable, "-m", "fuyou.cli.main", "finetune", model, "--data", data, "--output", out]
    cmd += ["--steps", str(steps), "--seq-len", str(SEQ), "--micro-batch-size", "1", "--no-progress", *flags]
    cmd += ["--trace", os.path.join(work, f"{name}.trace.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "FUYOU_CACHE": f"{work}/cache"})
    if r.returncode:
        return {"bench": "plan_truth", "setting": name, "error": r.stderr.strip().splitlines()[-1:]}
    run = json.loads(open(os.path.join(out, "run.json")).read())
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f][warmup:]
    times = [x["step_time_s"] for x in lines]
    measured = statistics.median(times)
    busy = {r: statistics.median(x["busy_frac"][r] * x["step_time_s"] for x in lines) for r in lines[0]["busy_frac"]}
    plan = run["plan"]
    prof = json.loads(open(plan["profile"]).read()) if plan.get("profile") and os.path.exists(plan["profile"]) else {}
    figures = {k: prof.get(k) for k in ("ssd_read_Bps", "ssd_write_Bps", "io_cpu_s_per_byte", "adam_params_per_s")}
    spans = compute_spans(os.path.join(work, f"{name}.trace.json"), model, plan.get("profile"), flags)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "bench": "plan_truth",
        "setting": name,
        "flags": flags,
        "precision": run["precision"]["precision"],
        "precision_reason": run["precision"]["reason"],
        "predicted_step_s": plan.get("predicted_step_s"),
        "measured_step_s": measured,
        "step_times_s": times,
        "predicted_over_measured": plan["predicted_step_s"] / measured if plan.get("predicted_step_s") else None,
        "bottleneck": plan.get("predicted_bottleneck"),
        "busy_s": {"predicted": plan.get("predicted_busy_s"), "measured_median": busy},
        "profile": plan.get("profile"),
        "profile_check": run.get("profile_check"),
        "profile_figures": figures,
        "compute_spans_ms": spans,
    }


def compute_spans(trace: str, model: str, profile: str | None, flags: list[str]) -> dict:
    """The last step's compute spans by kind (``fwd layer``, ``bwd layer``, ``head fwd+bwd``, …): median ms,
    and beside a layer's the profile's figure for one layer at the run's tokens, as ``graph.StepGraph``
    charges it without recompute (backward: with the gradient buffer's zeroing and add; a LoRA run's: input
    gradients only; none where ``--freeze`` mixes frozen and trained layers) — where the step's compute
    time goes, and which part the cost model misses."""
    import re

    if not os.path.exists(trace):
        return {}
    spans: dict[str, list[float]] = {}
    for e in json.load(open(trace))["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "compute":
            spans.setdefault(re.sub(r"\.\d+", "", e["name"]), []).append(e["dur"] / 1e3)
    out = {k: {"n": len(v), "median_ms": statistics.median(v)} for k, v in spans.items()}
    if profile and os.path.exists(profile):
        from fuyou.models.description import describe_model
        from fuyou.models.hf_io import load_config
        from fuyou.planner.profile import load_profile

        hw, shape = load_profile(profile), describe_model(load_config(model))
        layer = next(b for b in shape.blocks if b.kind == "layer")
        f = layer.fwd_flops_per_token(shape.hidden, SEQ) * SEQ
        zero = hw.compute_bytes * layer.numel / hw.device_mem_Bps
        predicted = {"fwd layer": f / hw.flops_per_s(SEQ)}
        if "--lora-rank" in flags:
            predicted["bwd layer"] = f / hw.flops_per_s(SEQ, backward=True)
        elif "--freeze" not in flags:
            predicted["bwd layer"] = zero + layer.numel / hw.grad_add_rate + 2 * f / hw.flops_per_s(SEQ, backward=True)
        for k, v in predicted.items():
            if k in out:
                out[k]["profile_ms"] = v * 1e3
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Hugging Face model directory (default: the demo's SmolLM2-135M)")
    ap.add_argument("--only", default=None, help="comma list of settings (default: all)")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--dir", default=None, help="work directory's parent (default: /work or the temp dir)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from fuyou.data.demo_corpus import write_demo_dataset
    from fuyou.run.demo import _random_model, demo_model_dir

    names = a.only.split(",") if a.only else list(SETTINGS)
    if a.smoke:
        names, a.steps, a.warmup = ["ssd_noclip_fp32", "lora8"], 3, 1
    base = a.dir or ("/work" if os.path.isdir("/work") else tempfile.gettempdir())
    work = tempfile.mkdtemp(prefix="fuyou-plan-truth-", dir=base)
    try:
        data, _ = write_demo_dataset(os.path.join(work, "data"))
        model = _random_model(os.path.join(work, "tiny")) if a.smoke else (a.model or demo_model_dir()[0])
        moe = None
        rows = []
        for name in names:
            if name in MOE and not a.smoke:
                moe = moe or moe_model(os.path.join(work, "moe"))
            rec = run_setting(name, SETTINGS[name], moe if name in MOE else model, data, work, a.steps, a.warmup)
            rec["model"] = os.path.basename(os.path.normpath(moe if name in MOE else model))
            rec["hardware"] = hardware_info([work])
            emit(rec, a.out)
            rows.append(rec)
        for rec in rows:
            if "error" in rec:
                print(f"| {rec['setting']} | failed: {rec['error']} |", file=sys.stderr)
            else:
                print(
                    f"| {rec['setting']} | {rec['precision']} | {rec['predicted_step_s']:.2f} | "
                    f"{rec['measured_step_s']:.2f} | {rec['predicted_over_measured']:.2f} | {rec['bottleneck']} |",
                    file=sys.stderr,
                )
        print("\nbusy seconds per resource, predicted / measured (median of the measured steps):", file=sys.stderr)
        for rec in rows:
            if "error" not in rec:
                pred, meas = rec["busy_s"]["predicted"] or {}, rec["busy_s"]["measured_median"]
                cells = [f"{r} {pred.get(r, 0):.2f}/{meas.get(r, 0):.2f}" for r in sorted(set(pred) | set(meas))]
                print(f"| {rec['setting']} | " + " | ".join(cells) + " |", file=sys.stderr)
        print("\nthe last step's compute spans, median ms (profile's figure for one such block):", file=sys.stderr)
        for rec in rows:
            if "error" not in rec:
                cells = [
                    f"{k} {v['median_ms']:.1f}" + (f" ({v['profile_ms']:.1f})" if "profile_ms" in v else "")
                    for k, v in sorted(rec["compute_spans_ms"].items())
                ]
                print(f"| {rec['setting']} | " + " | ".join(cells) + " |", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
