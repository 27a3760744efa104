"""Checkpoint cost: disk use of N checkpoints and the training stall per checkpoint, side by side
with a copy-based checkpoint (``shutil.copy2`` of the same committed files) on the same disk.

    python bench/bench_checkpoint.py              # 30M-param Llama, 6 steps, a checkpoint after each
    python bench/bench_checkpoint.py --smoke
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
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench.common import emit, hardware_info  # noqa: E402
from fuyou.checkpoint import take  # noqa: E402
from fuyou.checkpoint.snapshot import disk_usage  # noqa: E402
from fuyou.device import get_backend  # noqa: E402
from fuyou.device.precision import choose_precision  # noqa: E402
from fuyou.engine import Engine, EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dir", default="/work" if os.path.isdir("/work") else None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.steps = 2, 64, 2
    work = tempfile.mkdtemp(prefix="fuyou-bench-ckpt-", dir=a.dir)
    try:
        run(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(a: argparse.Namespace, work: str) -> None:
    cfg = LlamaConfig(
        num_hidden_layers=a.layers,
        hidden_size=a.hidden,
        intermediate_size=3 * a.hidden,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8000,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    sd = LlamaForCausalLM(cfg).state_dict()
    nparams = sum(v.numel() for v in sd.values())
    ssd = os.path.join(work, "ssd")
    os.makedirs(ssd)
    precision = choose_precision("auto", get_backend("auto")).precision  # as `fuyou finetune` would run here
    ec = EngineConfig(ssd_dirs=(ssd,), cpu_memory="1GiB", max_grad_norm=1.0, precision=precision)
    ids = torch.randint(0, 8000, (2, 128), generator=torch.Generator().manual_seed(0))
    steps, stalls, links, copies, usage = [], [], [], [], []
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        state = sum(e.nbytes for e in eng.store.extents)
        base = disk_usage([ssd])
        for i in range(a.steps):
            steps.append(eng.train_step(ids)["step_time_s"])
            t0 = time.perf_counter()
            eng.flush()
            info = take(eng.store, f"c{i}", {"step": i})
            stalls.append(time.perf_counter() - t0)
            links.append(info["stall_s"])
            usage.append(disk_usage([ssd]))
            body, files = eng.store.committed()
            dst = os.path.join(work, f"copy{i}")
            os.makedirs(dst)
            t0 = time.perf_counter()
            for _, f in files:
                shutil.copy2(os.path.join(ssd, f), dst)
            os.sync()
            copies.append(time.perf_counter() - t0)
            shutil.rmtree(dst)
    emit(
        {
            "bench": "checkpoint",
            "smoke": a.smoke,
            "params": nparams,
            "state_bytes": state,
            "precision": precision,
            "files_per_checkpoint": info["files"],
            "store_bytes_before": base,
            "disk_bytes_after_each": usage,
            "extra_bytes_per_checkpoint": [u - base for u in usage],
            "step_s_median": statistics.median(steps),
            "stall_s": stalls,
            "stall_s_median": statistics.median(stalls),
            "stall_over_step": statistics.median(stalls) / statistics.median(steps),
            "link_s": links,
            "link_s_median": statistics.median(links),
            "link_over_step": statistics.median(links) / statistics.median(steps),
            "copy_checkpoint_s_median": statistics.median(copies),
            "link_vs_copy_speedup": statistics.median(copies) / statistics.median(stalls),
            "hardware": hardware_info([work]),
        },
        a.out,
    )


if __name__ == "__main__":
    main()
