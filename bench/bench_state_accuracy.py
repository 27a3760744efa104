"""Issue 34 item 3 — what each optimizer-state format costs in accuracy, on a real model and real text.

``fuyou finetune`` with its defaults (clipping on, the planner, ``--precision auto``) fine-tunes a real model
(default: the demo's SmolLM2-135M-Instruct) on real text (the demo corpus: Python's own documentation,
``fuyou.data.demo_corpus``; its held-out topics as ``--eval-data``) once per format — ``fp32``, ``split``,
``bf16``, ``int8`` — with the same data order and seed, plus one ``fp32`` run with another seed (its distance from the
first is the run-to-run noise a lossy format is judged against). Every run evaluates the held-out loss every
``--eval-every`` steps. Reported: the held-out loss along each run, its final value, the largest gap to the fp32
run along the way, the noise's, and whether ``split``'s exported fp32 masters equal ``fp32``'s bit for bit.

    python bench/bench_state_accuracy.py --dir /tmp/acc                      # 300 steps, 135M
    python bench/bench_state_accuracy.py --dir /tmp/acc --steps 20 --eval-every 10   # a smoke run
    python bench/bench_state_accuracy.py --dir /tmp/acc --only int8,fp32-seed1   # the others read from /tmp/acc

With ``--only`` the other runs are not run again: their results are read from the finished runs in ``--dir``
(the same arguments are the caller's to keep), and runs with none there are left out of the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import emit, hardware_info  # noqa: E402

RUNS = (("fp32", "fp32", 0), ("split", "split", 0), ("bf16", "bf16", 0), ("int8", "int8", 0), ("fp32-seed1", "fp32", 1))
"""(name, --optimizer-state, --seed)."""


def finetune(a: argparse.Namespace, model: str, train: str, held: str, name: str, fmt: str, seed: int) -> dict:
    """One ``fuyou finetune`` run; its held-out losses by step and its wall time."""
    out = os.path.join(a.dir, name)
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    args = [
        sys.executable, "-m", "fuyou.cli.main", "finetune", model, "--data", train, "--eval-data", held,
        "--eval-every", str(a.eval_every), "--output", out, "--steps", str(a.steps), "--seq-len", str(a.seq_len),
        "--micro-batch-size", str(a.micro_batch_size), "--lr", str(a.lr), "--lr-schedule", "constant",
        "--cpu-memory", a.cpu_memory, "--optimizer-state", fmt, "--seed", str(seed), "--no-progress",
        "--save-every", "0",
    ]  # fmt: skip
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return results(a, name) | {"wall_s": time.perf_counter() - t0}


def results(a: argparse.Namespace, name: str) -> dict:
    """A finished run's held-out losses by step and last training loss (``wall_s`` None: not timed here)."""
    out = os.path.join(a.dir, name)
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    evals = {x["step"]: x["eval_loss"] for x in lines if x.get("eval_loss") is not None}
    run = json.load(open(os.path.join(out, "run.json")))
    evals.setdefault(0, run.get("eval_loss_before"))
    evals.setdefault(a.steps, run.get("eval_loss_after"))
    return {"eval_loss": dict(sorted(evals.items())), "train_loss_last": lines[-1]["loss"], "wall_s": None}


def masters(a: argparse.Namespace, name: str):  # noqa: ANN201 - a dict of tensors
    """The run's fp32 masters, exported."""
    from safetensors.torch import load_file

    out = os.path.join(a.dir, name + "-fp32")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "fuyou.cli.main", "export", os.path.join(a.dir, name), out, "--dtype", "fp32"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    tensors = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            tensors |= load_file(os.path.join(out, f))
    return tensors


def gap(x: dict, y: dict) -> float:
    """The largest |difference| of two runs' held-out losses at the steps both evaluated."""
    return max(abs(x[s] - y[s]) for s in x if s in y and x[s] is not None and y[s] is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--model", help="a model directory (default: the demo's SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--cpu-memory", default="2GiB")
    ap.add_argument("--only", help="comma list of runs to run (default: all); the others are read from --dir")
    a = ap.parse_args()
    import torch

    from fuyou.data.demo_corpus import write_demo_dataset
    from fuyou.run.demo import demo_model_dir

    os.makedirs(a.dir, exist_ok=True)
    model = a.model or demo_model_dir()[0]
    train, held = write_demo_dataset(os.path.join(a.dir, "data"))
    only = a.only.split(",") if a.only else [n for n, _, _ in RUNS]
    runs = {}
    for name, fmt, seed in RUNS:
        if name in only:
            runs[name] = finetune(a, model, train, held, name, fmt, seed)
        elif os.path.exists(os.path.join(a.dir, name, "run.json")):
            runs[name] = results(a, name)
    identical = None  # not compared: no finished split (or fp32) run in --dir
    if "fp32" in runs and "split" in runs:
        fp32, split = masters(a, "fp32"), masters(a, "split")
        identical = fp32.keys() == split.keys() and all(
            fp32[k].view(torch.int32).equal(split[k].view(torch.int32)) for k in fp32
        )
    base = runs["fp32"]["eval_loss"]
    summary = {n: {"final_eval_loss": list(r["eval_loss"].values())[-1], "max_gap_to_fp32": gap(r["eval_loss"], base)}
               for n, r in runs.items()}  # fmt: skip
    emit({"bench": "state_accuracy", "hardware": hardware_info([a.dir]), "model": model, "steps": a.steps,
          "seq_len": a.seq_len, "micro_batch_size": a.micro_batch_size, "lr": a.lr, "runs": runs,
          "summary": summary, "split_masters_equal_fp32": identical})  # fmt: skip
    print(
        "| run | held-out loss at " + ", ".join(str(s) for s in base) + " | max gap to fp32 | wall s |", file=sys.stderr
    )
    for n, r in runs.items():
        losses = ", ".join(f"{v:.4f}" for v in r["eval_loss"].values())
        wall = "read" if r["wall_s"] is None else f"{r['wall_s']:.0f}"
        print(f"| {n} | {losses} | {summary[n]['max_gap_to_fp32']:.4f} | {wall} |", file=sys.stderr)
    print(f"split's exported fp32 masters equal fp32's bit for bit: {identical}", file=sys.stderr)


if __name__ == "__main__":
    main()
