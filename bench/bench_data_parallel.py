"""Data-parallel ranks on this machine (issue 17): per-rank SSD bytes, bytes communicated and step time
for 1, 2 and 3 CPU ranks (gloo over loopback), the same global batch, side by side in one run.

Each world size runs as that many local processes (``torchrun``'s environment, set here), every one
training a random Llama of ``--hidden``/``--layers`` through ``fuyou.engine.Engine`` with the CLI's
defaults that matter here (bf16 compute on a machine with fast bf16, else fp32; clipping on, so the
clipping schedule; ``--cpu-memory`` per rank). The one-rank run is the reference: ratios are N ranks'
figure ÷ one rank's. Step time is the median over ``--steps`` steps after ``--warmup`` (rank 0's);
bytes are per rank per step. On a machine with fewer cores than ranks × the engine's threads the
ranks share the cores, so step time measures overhead, not speed-up.

    python bench/bench_data_parallel.py [--ranks 1 2 3] [--hidden 512 --layers 4 --seq 256 --batch 6] [--smoke]

Prints one JSON line per rank count (machine description, figures, ratios to one rank) and the
Markdown table for ``bench/RESULTS.md`` on stderr. ``--smoke``: a tiny model, 1 and 2 ranks, three steps after one.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, hardware_info  # noqa: E402


def child(args: argparse.Namespace) -> None:
    """One rank: train, report medians (rank 0) and byte counts (every rank) as JSON on stdout."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fuyou.engine import Engine, EngineConfig, Plan

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cfg = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 32 * 32,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    sd = LlamaForCausalLM(cfg).state_dict()
    per = args.batch // world
    ec = EngineConfig(
        ssd_dirs=(args.ssd,),
        precision=args.precision,
        cpu_memory=args.cpu_memory,
        max_grad_norm=1.0,
        lr=1e-5,
        plan=Plan(grad_accum=per),
        adam_threads=max(1, (os.cpu_count() or 1) // world),
    )
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(args.warmup + args.steps)]
    times, steps = [], []
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        for i, ids in enumerate(data):
            st = eng.train_step(ids[rank * per : (rank + 1) * per])
            if i >= args.warmup:
                times.append(st.step_time_s)
                steps.append(st)
        # each step's bytes, its update's included (read after the steps: the overlap kept)
        read, written = [s.ssd_read_bytes for s in steps], [s.ssd_write_bytes for s in steps]
        comm = [s.comm_bytes for s in steps]
    print(
        json.dumps(
            {
                "rank": rank,
                "step_s": statistics.median(times),
                "read": statistics.median(read),
                "written": statistics.median(written),
                "comm": statistics.median(comm),
            }
        )
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, args: argparse.Namespace, base: str) -> list[dict]:
    """Launch ``world`` local ranks (torchrun's environment); their reports."""
    ssd = tempfile.mkdtemp(dir=base)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--ssd", ssd] + args.forward
    port, procs = free_port(), []
    for r in range(world):
        env = dict(os.environ)
        if world > 1:
            env |= {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r)}
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a rank of the {world}-rank run failed (exit {p.returncode})")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(outs, key=lambda o: o["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ssd", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=6, help="global batch (sequences); divisible by every rank count")
    ap.add_argument("--precision", default=None, help="bf16 or fp32 (default: bf16 where it is fast)")
    ap.add_argument("--cpu-memory", default="1GiB", help="host budget per rank")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 1 and 2 ranks, three steps after one")
    args = ap.parse_args()
    if args.smoke and not args.child:
        args.ranks, args.hidden, args.layers, args.vocab, args.seq, args.batch = [1, 2], 128, 2, 512, 32, 2
        args.steps, args.warmup = 3, 1  # steady state: the first step's reads depend on prefetch timing
    if args.precision is None:
        from fuyou.device import get_backend
        from fuyou.device.precision import choose_precision

        args.precision = choose_precision("auto", get_backend("cpu")).precision
    if args.child:
        child(args)
        return
    for n in args.ranks:
        if args.batch % n:
            raise SystemExit(f"--batch {args.batch} does not split over {n} ranks")
    keys = ("hidden", "layers", "vocab", "seq", "batch", "precision", "cpu_memory", "steps", "warmup")
    args.forward = [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    with tempfile.TemporaryDirectory(dir=args.dir) as base:
        results = {n: run(n, args, base) for n in args.ranks}
        report(args, results, base)


def report(args: argparse.Namespace, results: dict[int, list[dict]], base: str) -> None:
    """JSON lines on stdout, the RESULTS.md table on stderr."""
    one = results[args.ranks[0]]
    base_rw = one[0]["read"] + one[0]["written"]
    setup = {k: getattr(args, k) for k in ("hidden", "layers", "vocab", "seq", "batch", "precision", "cpu_memory")}
    for n, outs in results.items():
        emit(
            {
                "bench": "data_parallel",
                "hardware": hardware_info([base]),
                "smoke": args.smoke,
                **setup,
                "ranks": n,
                "step_s": outs[0]["step_s"],
                "step_ratio": outs[0]["step_s"] / one[0]["step_s"],
                "ssd_read_per_rank": [o["read"] for o in outs],
                "ssd_written_per_rank": [o["written"] for o in outs],
                "ssd_share_max_rank": max(o["read"] + o["written"] for o in outs) / base_rw,
                "comm_bytes_per_rank": outs[0]["comm"],
            }
        )
    table = [
        f"Llama hidden {args.hidden} × {args.layers} layers, vocab {args.vocab}, seq {args.seq}, global batch "
        f"{args.batch}, {args.precision}, clipping on, --cpu-memory {args.cpu_memory} per rank; median of "
        f"{args.steps} steps after {args.warmup}\n",
        "| ranks | step s (rank 0) | ÷ 1 rank | SSD read MB/rank/step | SSD write MB/rank/step | "
        "÷ 1 rank (r+w, max rank) | comm MB/rank/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, outs in results.items():
        rw = max(o["read"] + o["written"] for o in outs)
        reads = "/".join(f"{o['read'] / 1e6:.1f}" for o in outs)
        writes = "/".join(f"{o['written'] / 1e6:.1f}" for o in outs)
        table.append(
            f"| {n} | {outs[0]['step_s']:.2f} | {outs[0]['step_s'] / one[0]['step_s']:.2f} | {reads} | {writes} | "
            f"{rw / base_rw:.3f} | {outs[0]['comm'] / 1e6:.1f} |"
        )
    print("\n".join(table), file=sys.stderr)


if __name__ == "__main__":
    main()
