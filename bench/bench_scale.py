"""P5 — scale: a Llama-shape model of ≥ 1.5B parameters trained for 2 steps with a host budget of
≤ 1/10 of its fp32 optimizer state (master + m + v = 12 B/param), peak RSS measured.

The model is random-init and never whole in RAM: the Hugging Face skeleton lives on the meta device
(the engine builds its own), and the engine's import pulls tensors from a lazy mapping whose
``__getitem__`` makes each one on demand (normal(0, initializer_range) for matrices, ones for
norms, from a generator seeded by the tensor's name), one block at a time. compute weights in the
precision ``fuyou finetune`` would pick here (``--precision``), fp32 master/m/v, every decoder layer
``recompute``, clipping on as ``fuyou finetune`` defaults to (``--max-grad-norm``; gradients parked on
SSD where the budget is short), store under ``--dir``.

Memory is measured two ways: ``ru_maxrss`` (the kernel's peak for the process) and a thread that
samples ``VmRSS`` from /proc/self/status every 10 ms, kept per phase (imports, engine build +
import into the store, each step). On the CPU backend the "device" is host RAM too, so the fake
device capacity (``--gpu-memory``) is memory the process uses besides the host budget; both are
reported.

    python bench/bench_scale.py                       # ≥ 1.5B params (~45 GB of store on --dir)
    python bench/bench_scale.py --preset llama3       # 1.26B with Llama 3's 128 k vocabulary (~35 GB)
    python bench/bench_scale.py --preset llama550m --cpu-memory 768MiB   # issue 31's case
    python bench/bench_scale.py --smoke               # tiny (48 small layers), same 1/10 rule; seconds
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_engine import ForeignLoad, code_version, llama_config  # noqa: E402
from bench.common import emit, hardware_info  # noqa: E402
from fuyou.engine import Engine, EngineConfig, Plan  # noqa: E402
from fuyou.models.blocks import parse_slice  # noqa: E402
from fuyou.units import parse_size  # noqa: E402

STATE_BYTES_PER_PARAM = 12  # fp32 master + m + v


def vm_rss() -> int:
    """Current resident set size in bytes (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def ru_maxrss() -> int:
    """Peak RSS of this process so far, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssSampler:
    """Samples VmRSS every ``period`` s in a thread; keeps the peak per named phase."""

    def __init__(self, period: float = 0.01) -> None:
        self.period, self.phase, self.peaks = period, "start", {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            r = vm_rss()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), r)
            time.sleep(self.period)

    def set_phase(self, name: str) -> None:
        r = vm_rss()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), r)
        self.phase = name
        self.peaks[name] = max(self.peaks.get(name, 0), r)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class LazyInit(Mapping):
    """A state dict whose tensors are made on demand (seeded by name and row block), never all at once.

    A matrix is made ``ROWS`` rows at a time, each block from its own generator, so rows [lo, hi) of
    it (the ``slice_key`` of an embedding or LM head split by vocabulary rows, which the engine's
    import asks for by that key) are made alone, without the whole matrix."""

    ROWS = 1024

    def __init__(self, shapes: dict[str, tuple[int, ...]], std: float, seed: int = 0) -> None:
        self.shapes, self.std, self.seed = shapes, std, seed
        self.made = 0

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        rows = parse_slice(key)
        return key in self.shapes if rows is None else rows[0] in self.shapes

    def __getitem__(self, key: str) -> torch.Tensor:
        rows = parse_slice(key)
        base, lo, hi = (key, 0, self.shapes[key][0]) if rows is None else rows
        shape = self.shapes[base]
        self.made += 1
        if base.endswith("norm.weight"):
            return torch.ones((hi - lo, *shape[1:]))
        out = torch.empty((hi - lo, *shape[1:]))
        for b in range(lo // self.ROWS, -(-hi // self.ROWS)):
            a, z = max(lo, b * self.ROWS), min(hi, (b + 1) * self.ROWS)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(f"{base}#{b}".encode()))
            block = torch.empty((min(shape[0], (b + 1) * self.ROWS) - b * self.ROWS, *shape[1:]))
            block.normal_(0.0, self.std, generator=g)
            out[a - lo : z - lo] = block[a - b * self.ROWS : z - b * self.ROWS]
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def meta_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes, from a skeleton on the meta device (no memory)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return {k: tuple(p.shape) for k, p in model.named_parameters()}


PRESETS = {
    # Qwen2-1.5B widths (hidden 1536, MLP 8960, 12 heads / 2 KV heads) with a 32k Llama vocabulary,
    # 30 layers: 1.50B parameters. The largest block (embedding, 49M) sets the host buffers.
    "full": dict(hidden=1536, inter=8960, heads=12, kv_heads=2, layers=30, vocab=32000, batch=1, seq=128),
    # Llama-3.2-1B widths (hidden 2048, MLP 8192, 32 heads / 8 KV heads) with Llama 3's 128 k
    # vocabulary, untied, 12 layers: 1.26B parameters, of which the embedding and the head are 263M
    # each (4.3 decoder layers): unsplit they set the host floor (6 buffers of 525 MB in bf16); the
    # engine splits them by vocabulary rows (``Plan.vocab_groups``, 0: as needed) into 5 blocks each.
    "llama3": dict(hidden=2048, inter=8192, heads=32, kv_heads=8, layers=12, vocab=128256, batch=1, seq=128),
    # issue 31's 550 M Llama with a 49 k vocabulary, untied: its embedding and head (75 M each, 2.1
    # decoder layers) set the host floor at 888 MiB unsplit; run at --cpu-memory 768MiB.
    "llama550m": dict(hidden=1536, inter=4096, heads=12, kv_heads=4, layers=16, vocab=49152, batch=1, seq=128),
    # 48 equal small layers: the same 1/10 rule holds in fp32 too (host buffers ≈ 44 B × largest block).
    "smoke": dict(hidden=64, inter=128, heads=4, kv_heads=4, layers=48, vocab=64, batch=1, seq=16),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="store directory parent (default: a temp dir in /work or /tmp)")
    for k in ("hidden", "inter", "heads", "kv_heads", "layers", "vocab", "batch", "seq"):
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budget-frac", type=float, default=0.1, help="host budget ÷ fp32 state (≤ 0.1 for P5)")
    ap.add_argument("--cpu-memory", default=None, help="host budget in bytes or with a unit (overrides --budget-frac)")
    ap.add_argument("--gpu-memory", default=None, help="fake device capacity (CPU backend); default 1GiB (smoke 64MiB)")
    ap.add_argument("--depth", type=int, default=1, help="prefetch depth")
    ap.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="global-norm clipping as `fuyou finetune` defaults to (0 = off); with it every block's "
        "gradient is parked until backward ends, on SSD where the budget is short",
    )
    ap.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="compute dtype; auto: as `fuyou finetune` picks on this machine",
    )
    ap.add_argument("--keep-store", action="store_true", help="leave the store on disk")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="model shape (default: full; smoke with --smoke)"
    )
    ap.add_argument("--out", default=None, help="also append JSON lines to this file")
    a = ap.parse_args()
    for k, v in PRESETS[a.preset or ("smoke" if a.smoke else "full")].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.gpu_memory is None:
        a.gpu_memory = "64MiB" if a.smoke else "1GiB"
    with RssSampler() as rss:
        rss.set_phase("imports")
        # every module the run will import (transformers' Llama, its loss, the numba Adam kernel), and
        # the meta skeleton: after this the baseline holds the libraries, not the model
        import transformers.loss.loss_utils  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401

        import fuyou.optim.adam_numba  # noqa: F401

        cfg = llama_config(a.hidden, a.layers, a.inter, a.heads, a.kv_heads, a.vocab, a.seq)
        shapes = meta_shapes(cfg)
        baseline = vm_rss()
        run(a, rss, baseline, cfg, shapes)


def run(a: argparse.Namespace, rss: RssSampler, baseline: int, cfg: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    state = STATE_BYTES_PER_PARAM * params
    budget = int(state * a.budget_frac) if a.cpu_memory is None else parse_size(a.cpu_memory, "--cpu-memory")
    base = a.dir or ("/work" if os.path.isdir("/work") else tempfile.gettempdir())
    from fuyou.device import get_backend
    from fuyou.device.precision import choose_precision

    precision = choose_precision(a.precision, get_backend("auto")).precision
    need_disk = 2 * (12 + (2 if precision == "bf16" else 4)) * params  # weights + fp32 master/m/v, 2 versions
    free = shutil.disk_usage(base).free
    if free < need_disk * 1.05:
        sys.exit(f"{base} has {free / 1e9:.1f} GB free; the store needs ~{need_disk / 1e9:.1f} GB (2 versions)")
    work = tempfile.mkdtemp(prefix="fuyou-bench-scale-", dir=base)
    hw = {**hardware_info([work]), "code": code_version()}
    nblocks = a.layers + 2
    plan = Plan(prefetch_depth=a.depth, activation_policy=("keep",) + ("recompute",) * a.layers + ("keep",))
    ec = EngineConfig(
        ssd_dirs=(work,),
        precision=precision,
        cpu_memory=budget,
        gpu_memory=a.gpu_memory,
        lr=1e-4,
        weight_decay=0.01,
        plan=plan,
        max_grad_norm=a.max_grad_norm,
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    steps: list[dict] = []
    eng = None
    load = ForeignLoad()
    try:
        rss.set_phase("build")
        t = time.perf_counter()
        lazy = LazyInit(shapes, std=cfg.initializer_range)
        eng = Engine.from_state_dict(cfg, lazy, ec)
        build_s = time.perf_counter() - t
        pool_reserved = eng.pool.reserved
        effective = {
            "vocab_groups": eng.plan.vocab_groups,
            "prefetch_depth": eng.plan.prefetch_depth,
            "state_buffers": eng.plan.state_buffers,
            "state_chunk_elems": eng.layout.state_chunk,
            "schedule": eng.plan.schedule,
            "park_ram_blocks": eng.plan.park_ram_blocks,
        }
        for i in range(a.steps):
            rss.set_phase(f"step{i + 1}")
            st = eng.train_step(ids)
            steps.append(
                {
                    "step": i + 1,
                    "loss": st.loss,
                    "grad_norm": st.grad_norm,
                    "applied": st.applied,
                    "step_time_s": st.step_time_s,
                    "tokens_per_s": st.tokens_per_s,
                    "busy_s": st.busy_s,
                    "bottleneck": st.bottleneck,
                    "io": st.io,
                    "vmrss_peak_bytes": None,
                }
            )
        for s in steps:  # each step's bytes, its update's included (read after the steps: the overlap kept)
            io = s.pop("io").get()
            s["ssd_read_bytes"], s["ssd_write_bytes"] = io["ssd_read"], io["ssd_write"]
        rss.set_phase("close")
        dev = eng.backend.memory()
        eng.close()
        eng = None
    finally:
        if eng is not None:
            eng.close()
        if not a.keep_store:
            shutil.rmtree(work, ignore_errors=True)
    rss.set_phase("done")
    for s in steps:
        s["vmrss_peak_bytes"] = rss.peaks.get(f"step{s['step']}")
    peak_sampled = max(rss.peaks.values())
    train_peak = max(rss.peaks.get(f"step{i + 1}", 0) for i in range(a.steps))
    gpu_bytes = ec.gpu_bytes or 0
    emit(
        {
            "bench": "scale_p5",
            "smoke": a.smoke,
            "model": {
                "arch": "LlamaForCausalLM (untied)",
                "hidden": a.hidden,
                "intermediate": a.inter,
                "heads": a.heads,
                "kv_heads": a.kv_heads,
                "layers": a.layers,
                "vocab": a.vocab,
                "params": params,
                "blocks": nblocks,
            },
            "batch": a.batch,
            "seq": a.seq,
            "precision": f"{precision} compute, fp32 master/m/v",
            "max_grad_norm": a.max_grad_norm,
            "plan": {
                "activation_policy": f"keep(embed), recompute × {a.layers}, keep(head)",
                "prefetch_depth": a.depth,
                "schedule": effective["schedule"],
                "state_buffers": plan.state_buffers,
                "effective": effective,
            },
            "fp32_state_bytes": state,
            "host_budget_bytes": budget,
            "state_over_budget": state / budget,
            "target_state_over_budget": 10.0,
            "met_ratio": state / budget >= 10.0,
            "host_pool_reserved_bytes": pool_reserved,
            "device_capacity_bytes": gpu_bytes,
            "device_peak_bytes": dev.peak,
            "rss_baseline_after_imports_bytes": baseline,
            "rss_peak_ru_maxrss_bytes": ru_maxrss(),
            "rss_peak_sampled_bytes": peak_sampled,
            "rss_peak_training_bytes": train_peak,
            "rss_peak_by_phase_bytes": rss.peaks,
            "rss_training_minus_baseline_bytes": train_peak - baseline,
            "rss_training_within_budget_plus_device": train_peak - baseline <= budget + dev.peak,
            "build_and_import_s": build_s,
            "steps": steps,
            "losses": [s["loss"] for s in steps],
            "step_times_s": [s["step_time_s"] for s in steps],
            "store_dir": work,
            "machine_load": load.result(),
            "hardware": hw,
        },
        a.out,
    )


if __name__ == "__main__":
    main()
