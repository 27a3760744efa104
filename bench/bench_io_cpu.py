"""Item 8 — the CPU cost of moving bytes: CPU seconds per GB per stage, and Fuyou ÷ plain (÷ DeepSpeed).

Fuyou trains a real model (default: the demo's SmolLM2-135M-Instruct from ``~/.cache/fuyou``, see
``fuyou/run/demo.py``) the way ``fuyou finetune`` does — plan from the planner for ``--cpu-memory``,
clipping on, optimizer state on SSD — and reads what the engine itself spends:

* per stage (``weights``, ``state``, ``grad_park``, ``activations`` on SSD; ``ram_weights``/``ram_state``
  for the RAM tier) and op (``read``, ``write``, ``fsync``, ``copy_in``, ``copy_out``): CPU seconds of
  the thread that did the work (``time.thread_time`` inside the I/O backend's block tasks and the RAM
  tier's copies: ``fuyou/storage/cpu_meter.py``), bytes, and CPU seconds per 10⁹ bytes;
* per thread group (``/proc/self/task/*/schedstat``: on-CPU nanoseconds of every thread, named from
  ``threading``'s native ids): the I/O pool, the gradient-parking writer, the Adam feeder and
  worker, the training thread and the native (torch / numba) worker threads. The I/O pool's total
  minus its tasks' CPU is the Python overhead around the tasks (queues, futures, callbacks).

The step-time references are ``--peer`` (``../shared/peers/deepspeed_baseline.py``) run as
subprocesses on the same model, batch and sequence length: ``--mode plain`` (in-RAM PyTorch +
``torch.optim.AdamW(fused=True)``, with this interpreter) and ``--mode nvme`` (DeepSpeed ZeRO-Infinity,
with ``--ds-python``, a separate environment holding DeepSpeed), one after the other in the same
run; each reports the median of ``--repeats`` steps after ``--warmup``, as Fuyou does here. The
record carries Fuyou ÷ plain and Fuyou ÷ DeepSpeed (target of the issue: ÷ plain ≤ 1.10).

    python bench/bench_io_cpu.py --dir /tmp/iocpu                  # full run (SmolLM2-135M, fp32)
    python bench/bench_io_cpu.py --dir /tmp/iocpu --references plain
    python bench/bench_io_cpu.py --smoke                           # seconds; what the tests run
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
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_engine import ForeignLoad  # noqa: E402
from bench.common import emit, hardware_info  # noqa: E402
from fuyou.engine import Engine, EngineConfig  # noqa: E402
from fuyou.storage import checksum  # noqa: E402
from fuyou.storage.cpu_meter import CpuMeter  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.join(os.path.dirname(ROOT), "shared", "peers", "deepspeed_baseline.py")
LR = 1e-4
"""The peer script's default learning rate (weight decay 0, betas 0.9/0.999, eps 1e-8, as it uses)."""


# ---------------------------------------------------------------------------------- per-thread CPU
def thread_names() -> dict[int, str]:
    """Native thread id → Python thread name, for the threads Python started."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def thread_group(name: str | None) -> str:
    """The group a thread's CPU time is reported under (None: a thread Python did not start)."""
    if name is None:
        return "native_workers"
    for prefix, group in (
        ("fuyou-io-", "io_pool"),
        ("fuyou-grad-park", "grad_park_writer"),
        ("fuyou-adam-feeder", "adam_feeder"),
        ("fuyou-adam", "adam_worker"),
        ("MainThread", "main"),
    ):
        if name.startswith(prefix):
            return group
    return "other_python"


def thread_cpu() -> dict[int, float]:
    """On-CPU seconds of every thread of this process so far (``schedstat``, ns resolution)."""
    out = {}
    base = "/proc/self/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return out


def group_cpu(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds per thread group between two ``thread_cpu`` readings."""
    names = thread_names()
    out: dict[str, float] = {}
    for tid, t in after.items():
        g = thread_group(names.get(tid))
        out[g] = out.get(g, 0.0) + t - before.get(tid, 0.0)
    return out


# ---------------------------------------------------------------------------------- Fuyou
def fuyou_engine(a: argparse.Namespace, model_dir: str, store: str) -> tuple[Engine, dict]:
    """An engine on ``model_dir`` planned as ``fuyou finetune`` plans it; returns (engine, plan info)."""
    from fuyou.models.hf_io import load_config
    from fuyou.run.plan_choice import PlanRequest, choose_plan

    config = load_config(model_dir)
    req = PlanRequest(
        model_config=config,
        store_dirs=(store,),
        cpu_memory=a.cpu_memory,
        device="cpu",
        precision=a.precision,
        micro_batch_size=a.micro_batch_size,
        seq_len=a.seq_len,
        clip=a.max_grad_norm > 0,
        mode=a.plan,
    )
    chosen = choose_plan(req)
    ec = EngineConfig(
        ssd_dirs=(store,),
        device="cpu",
        cpu_memory=a.cpu_memory,
        precision=a.precision,
        lr=LR,
        max_grad_norm=a.max_grad_norm,
        plan=chosen.plan,
        checksums=not a.no_checksums,
    )
    eng = Engine.from_pretrained(model_dir, ec)
    return eng, {**chosen.info, "plan_run": eng.plan.to_json()}


def step_record(eng: Engine, meter: CpuMeter, ids: torch.Tensor) -> dict:
    """One Fuyou step: wall seconds, CPU per stage (meter) and per thread group, SSD bytes."""
    before, cpu0 = meter.snapshot(), thread_cpu()
    eng.timeline.clear()
    load = ForeignLoad()
    t0 = time.perf_counter()
    st = eng.train_step(ids)
    wall = time.perf_counter() - t0
    foreign = load.result()["foreign_cores"]
    stages = CpuMeter.diff(meter.snapshot(), before)
    groups = group_cpu(cpu0, thread_cpu())
    io_tasks = sum(v["cpu_s"] for k, v in stages.items() if not k.startswith("ram_"))
    summ = eng.timeline.summary(t0, t0 + wall)
    return {
        "wall_s": wall,
        "stages": stages,
        "threads_cpu_s": groups,
        "process_cpu_s": sum(groups.values()),
        "io_pool_outside_tasks_cpu_s": groups.get("io_pool", 0.0) - io_tasks,
        "io": st.io,  # the step's SSD bytes, read after the steps: the overlap kept
        "busy_s": summ["busy_s"],
        "foreign_cores": foreign,
    }


def summarize(steps: list[dict]) -> dict:
    """Medians over the measured steps; CPU per GB per stage = total CPU ÷ total bytes."""
    keys = sorted({k for s in steps for k in s["stages"]})
    stages = {}
    for k in keys:
        cpu = sum(s["stages"].get(k, {}).get("cpu_s", 0.0) for s in steps)
        nb = sum(s["stages"].get(k, {}).get("bytes", 0) for s in steps)
        stages[k] = {
            "cpu_s_per_step": cpu / len(steps),
            "gb_per_step": nb / 1e9 / len(steps),
            "cpu_s_per_gb": cpu / (nb / 1e9) if nb else None,
        }
    io = [k for k in keys if not k.startswith("ram_")]
    io_cpu = sum(stages[k]["cpu_s_per_step"] for k in io)
    io_gb = sum(stages[k]["gb_per_step"] for k in io)
    groups = sorted({g for s in steps for g in s["threads_cpu_s"]})
    med = statistics.median
    return {
        "median_step_s": med(s["wall_s"] for s in steps),
        "step_times_s": [round(s["wall_s"], 4) for s in steps],
        "stages": stages,
        "ssd_io_cpu_s_per_step": io_cpu,
        "ssd_io_gb_per_step": io_gb,
        "ssd_io_cpu_s_per_gb": io_cpu / io_gb if io_gb else None,
        "threads_cpu_s_per_step": {g: med(s["threads_cpu_s"].get(g, 0.0) for s in steps) for g in groups},
        "io_pool_outside_tasks_cpu_s_per_step": med(s["io_pool_outside_tasks_cpu_s"] for s in steps),
        "process_cpu_s_per_step": med(s["process_cpu_s"] for s in steps),
        "foreign_cores_median": med(s["foreign_cores"] for s in steps),
        "busy_s": {r: med(s["busy_s"][r] for s in steps) for r in steps[0]["busy_s"]},
    }


def run_fuyou(a: argparse.Namespace, model_dir: str, work: str) -> dict:
    """Fuyou's steps on ``model_dir``: warm-up, then ``--repeats`` measured, summarized."""
    from fuyou.models.hf_io import load_config

    vocab = load_config(model_dir).vocab_size
    store = os.path.join(work, "store")
    os.makedirs(store, exist_ok=True)
    eng, plan = fuyou_engine(a, model_dir, store)
    meter_io = eng.store.io
    meter = eng.store.io.meter = CpuMeter()
    if a.request_kib:
        eng.store.io.request_bytes = max(eng.store.io.block_bytes, a.request_kib << 10)
    g = torch.Generator().manual_seed(0)
    try:
        steps = []
        for i in range(a.warmup + a.repeats):
            ids = torch.randint(0, vocab, (a.micro_batch_size, a.seq_len), generator=g)
            rec = step_record(eng, meter, ids)
            print(f"fuyou step {i}: {rec['wall_s']:.3f} s", file=sys.stderr, flush=True)
            if i >= a.warmup:
                steps.append(rec)
        for rec in steps:
            io = rec.pop("io").get()
            rec["ssd_read_bytes"], rec["ssd_write_bytes"] = io["ssd_read"], io["ssd_write"]
    finally:
        eng.close()
        shutil.rmtree(store, ignore_errors=True)
    return {"plan": plan, "request_bytes": meter_io.request_bytes, "crc": checksum.implementation(), **summarize(steps)}


# ---------------------------------------------------------------------------------- references
def run_peer(a: argparse.Namespace, mode: str, model_dir: str, work: str) -> dict:
    """Run the peer script in ``mode`` (plain | nvme) as a subprocess; its JSON record, or an error."""
    python = sys.executable if mode == "plain" else a.ds_python
    if not python or not os.path.exists(python):
        return {"mode": mode, "error": f"no interpreter for --mode {mode} (--ds-python {python!r})"}
    cmd = [
        python,
        a.peer,
        "--model-dir",
        model_dir,
        "--mode",
        mode,
        "--steps",
        str(a.warmup + a.repeats),
        "--warmup",
        str(a.warmup),
        "--seq-len",
        str(a.seq_len),
        "--micro-batch-size",
        str(a.micro_batch_size),
        "--precision",
        a.precision,
        "--lr",
        str(LR),
    ]
    if mode == "nvme":
        cmd += ["--nvme-dir", os.path.join(work, "ds-swap")]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.peer_timeout)
    wall = time.perf_counter() - t0
    shutil.rmtree(os.path.join(work, "ds-swap"), ignore_errors=True)
    if r.returncode != 0 or not r.stdout.strip():
        return {"mode": mode, "error": (r.stderr.strip().splitlines() or ["?"])[-1][:300], "rc": r.returncode}
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    keep = ("median_step_s", "step_times_s", "peak_rss_mib", "median_read_bytes_per_step",
            "median_write_bytes_per_step", "torch_threads", "deepspeed")  # fmt: skip
    return {"mode": mode, "subprocess_wall_s": wall, **{k: rec[k] for k in keep if k in rec}}


def cpu_floor(fy: dict, plain_step_s: float) -> float:
    """The lowest Fuyou ÷ plain its own CPU work allows here: Fuyou's process CPU-seconds per step
    spread perfectly over every core (``os.cpu_count``), ÷ the plain step; at least 1. Above the
    target, only less CPU work per step (not better overlap) can reach it on this machine."""
    return max(plain_step_s, fy["process_cpu_s_per_step"] / (os.cpu_count() or 1)) / plain_step_s


# ---------------------------------------------------------------------------------- main
def tiny_model(work: str) -> str:
    """A random-init tiny Llama (the peer script's ``tiny`` shape: hidden 256, 4 layers, vocab 49152,
    tied embeddings) saved as a Hugging Face model directory."""
    from bench.bench_engine import build_model, llama_config

    cfg = llama_config(hidden=256, layers=4, inter=688, heads=4, kv_heads=4, vocab=49152, seq=256)
    cfg.tie_word_embeddings = True
    out = os.path.join(work, "tiny-model")
    build_model(cfg).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None, help="HF model directory (default: the demo's SmolLM2-135M)")
    ap.add_argument("--dir", default=None, help="store / swap directory (default: a temporary one)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--cpu-memory", default="1GiB", help="Fuyou's host budget (state stays on SSD)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping (as fuyou finetune's default)")
    ap.add_argument("--plan", choices=("auto", "rules"), default="auto")
    ap.add_argument("--no-checksums", action="store_true", help="store without CRC32C (to see their cost)")
    ap.add_argument("--request-kib", type=int, default=0,
                    help="bytes per I/O system call (KiB; 0: the backend's default; 1024: one block, as before item 8)")  # fmt: skip
    ap.add_argument("--crc", choices=("auto", "lib", "fast"), default=None, help="CRC32C implementation ($FUYOU_CRC)")
    ap.add_argument("--repeats", type=int, default=5, help="measured steps")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the measured ones")
    ap.add_argument("--references", default="plain,nvme", help="peer modes to run: plain, nvme (comma list)")
    ap.add_argument("--peer", default=PEER, help="the peer script")
    ap.add_argument("--ds-python", default=os.environ.get("DS_PYTHON", "/work/dsvenv/bin/python"),
                    help="interpreter with DeepSpeed, for --mode nvme")  # fmt: skip
    ap.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds per peer run")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, 2 steps, rules plan, plain reference only")
    ap.add_argument("--out", default=None, help="also append the JSON line to this file")
    a = ap.parse_args()
    if a.smoke:  # the plain reference only where the peer script is (it lives outside the repository)
        refs = "plain" if os.path.exists(a.peer) else ""
        a.repeats, a.warmup, a.seq_len, a.references, a.cpu_memory, a.plan = 2, 1, 32, refs, "512MiB", "rules"
    missing = [m for m in a.references.split(",") if m and not os.path.exists(a.peer)]
    if missing:
        raise SystemExit(
            f"the peer script {a.peer} does not exist (references {missing}); pass --peer or --references ''"
        )
    if a.crc:
        checksum.choose(a.crc)
    work = a.dir or tempfile.mkdtemp(prefix="fuyou-iocpu-")
    os.makedirs(work, exist_ok=True)
    try:
        if a.model_dir:
            model_dir, real = a.model_dir, True
        elif a.smoke:
            model_dir, real = tiny_model(work), False
        else:
            from fuyou.run.demo import demo_model_dir

            model_dir, real = demo_model_dir()
        refs = {m: run_peer(a, m, model_dir, work) for m in a.references.split(",") if m}
        fy = run_fuyou(a, model_dir, work)
        ratios = {f"fuyou_over_{m}": fy["median_step_s"] / r["median_step_s"] for m, r in refs.items()
                  if "median_step_s" in r}  # fmt: skip
        if "median_step_s" in refs.get("plain", {}):
            ratios["cpu_floor_over_plain"] = cpu_floor(fy, refs["plain"]["median_step_s"])
        emit(
            {
                "bench": "io_cpu",
                "model_dir": model_dir,
                "pretrained": real,
                "precision": a.precision,
                "seq_len": a.seq_len,
                "micro_batch_size": a.micro_batch_size,
                "cpu_memory": a.cpu_memory,
                "checksums": not a.no_checksums,
                "warmup": a.warmup,
                "repeats": a.repeats,
                "load_avg_1m": os.getloadavg()[0],
                "hardware": hardware_info([work]),
                "fuyou": fy,
                "references": refs,
                "ratios": ratios,
            },
            a.out,
        )
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
