"""P1 overlap and P2 out-of-core cost of the training engine, plus a Perfetto trace of one step.

Modes (``--mode``):

- ``p2`` — out-of-core cost: the same random-init Llama-shape model and the same batch, trained by
  Fuyou (store on ``--dir``) and by plain in-RAM PyTorch + ``torch.optim.AdamW`` (``fused=True``
  where the CPU build supports it), steps interleaved (reference, Fuyou, reference, Fuyou, …) so
  drift hits both alike; median of ``--repeats`` after ``--warmup``. One variant per activation
  policy (``--policies``) and Adam thread count (``--adam-threads``); each reports
  Fuyou ÷ reference. fp32: the reference trains fp32 weights. bf16: the reference is the same
  mixed-precision recipe Fuyou runs — bf16 weights for forward/backward, gradients cast to an fp32
  master copy, fused AdamW on the master, master copied back into the bf16 weights.
  Every Fuyou step of a p2 run also yields a P1 figure for the compute-bound setting.
- ``p1`` — overlap in an SSD-bound setting (few tokens, large layers): Fuyou alone.
- ``trace`` — one real step of a mid-size model written as Chrome-trace/Perfetto JSON (``--trace``).

P1 = step time ÷ the busiest resource's busy time, from the engine's own timeline (busy = union of
that resource's spans within the step). Reported twice: ``raw`` over the engine's six resources
(``ssd_read``, ``ssd_write``, ``h2d``, ``d2h``, ``compute``, ``adam``) and ``merged`` — on the CPU
backend the device compute, the copies and CPU Adam all run on the same cores, so they count as one
resource ``cpu`` (union of their spans), and SSD read + write as one resource ``ssd``
(``../shared/BENCHMARKS.md``). Each record also lists the largest idle gaps of the merged
bottleneck and what was in flight during them.

    python bench/bench_engine.py --mode p2                     # P2 (+P1 compute-bound), fp32
    python bench/bench_engine.py --mode p2 --precision bf16
    python bench/bench_engine.py --mode p1                     # P1, SSD-bound
    python bench/bench_engine.py --mode trace --trace bench/trace_step.json
    python bench/bench_engine.py --smoke                       # seconds; what the tests run
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import emit, hardware_info  # noqa: E402
from fuyou.engine import Engine, EngineConfig, Plan  # noqa: E402
from fuyou.timeline import RESOURCES, Span, union_length  # noqa: E402

LR, WD = 1e-4, 0.01
GROUPS = {"cpu": ("compute", "adam", "h2d", "d2h", "ram_copy"), "ssd": ("ssd_read", "ssd_write")}


# ---------------------------------------------------------------------------------- models
def llama_config(
    hidden: int,
    layers: int,
    inter: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    seq: int,
    experts: int = 0,
    top_k: int = 2,
) -> Any:
    """A Llama config (untied embeddings, no dropout) of the given shape; with ``experts``, a Mixtral
    of that shape (``experts`` experts of ``inter`` each, ``top_k`` per token) with its balance loss:
    the plain model computes it (``output_router_logits``) as Fuyou's default ``--moe-balance global``
    does (the same loss over one step's batch)."""
    from transformers import LlamaConfig, MixtralConfig

    shape = dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=max(seq, 128),
        tie_word_embeddings=False,
    )
    if experts:
        cfg = MixtralConfig(**shape, num_local_experts=experts, num_experts_per_tok=top_k, output_router_logits=True)
        cfg.architectures = ["MixtralForCausalLM"]
        return cfg
    cfg = LlamaConfig(**shape)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def build_model(cfg: Any, seed: int = 0) -> torch.nn.Module:
    """Random-init model of ``cfg`` in RAM (fp32, train mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def make_batch(vocab: int, batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    """Random token ids ``[batch, seq]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def n_params(model: torch.nn.Module) -> int:
    """Parameter count."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------- reference
def make_adamw(params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, str]:
    """``AdamW(fused=True)`` if this build runs it on CPU, else the default (foreach) one."""
    try:
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
        probe = [torch.nn.Parameter(torch.zeros(4))]
        probe[0].grad = torch.ones(4)
        torch.optim.AdamW(probe, lr=LR, fused=True).step()
        return opt, "fused"
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, lr=LR, weight_decay=WD), "default"


class Reference:
    """Plain in-RAM PyTorch training step: fp32, or bf16 weights with an fp32 master (Fuyou's recipe)."""

    def __init__(self, model: torch.nn.Module, precision: str) -> None:
        self.precision = precision
        if precision == "fp32":
            self.model = model
            self.opt, self.adam_kind = make_adamw(list(model.parameters()))
        else:
            self.master = [torch.nn.Parameter(p.detach().clone().float()) for p in model.parameters()]
            self.model = model.to(torch.bfloat16)
            self.opt, self.adam_kind = make_adamw(self.master)

    def step(self, ids: torch.Tensor) -> float:
        """One optimizer step on ``ids`` (labels = ids); returns the loss."""
        if self.precision == "fp32":
            self.opt.zero_grad(set_to_none=True)
            loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
            self.opt.step()
            return loss.item()
        self.model.zero_grad(set_to_none=True)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        work = list(self.model.parameters())
        for p, w in zip(self.master, work):
            p.grad = w.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, w in zip(self.master, work):
                w.copy_(p)
        return loss.item()


# ---------------------------------------------------------------------------------- Fuyou
def fuyou_engine(
    cfg: Any,
    state_dict: Any,
    store_dir: str,
    precision: str,
    policy: str,
    depth: int,
    adam_threads: int | None,
    state_buffers: int = 2,
    state_chunk: int | None = None,
    cpu_memory: str = "16GiB",
    micro_batches: int = 1,
    expert_groups: int = 1,
) -> Engine:
    """An engine with ``policy`` for every decoder layer (``keep`` for embed and head; a mixture of
    experts' layers split into ``expert_groups``, which take their layer's policy)."""
    nblocks = cfg.num_hidden_layers + 2
    plan = Plan(
        grad_accum=micro_batches,
        prefetch_depth=depth,
        state_buffers=state_buffers,
        activation_policy=("keep",) + (policy,) * (nblocks - 2) + ("keep",),
        expert_groups=expert_groups,
        **({"state_chunk": state_chunk} if state_chunk else {}),
    )
    ec = EngineConfig(
        ssd_dirs=(store_dir,),
        precision=precision,
        lr=LR,
        weight_decay=WD,
        cpu_memory=cpu_memory,
        plan=plan,
        adam_threads=adam_threads,
    )
    return Engine.from_state_dict(cfg, state_dict, ec)


def plan_desc(eng: Engine, policy: str, layers: int, threads: int | None) -> dict:
    """The plan the engine actually runs (the host-budget rules may have changed depth or chunk)."""
    p = eng.plan
    return {
        "activation_policy": f"keep(embed), {policy} × {layers} layers, keep(head)",
        "prefetch_depth": p.prefetch_depth,
        "grad_accum": p.grad_accum,
        "schedule": p.schedule,
        "state_buffers": p.state_buffers,
        "state_chunk_elems": eng.layout.state_chunk,
        "host_reserved_bytes": eng.pool.reserved,
        "adam_threads": threads or "default (all cores)",
        "expert_groups": p.expert_groups,
        "blocks": len(eng.layout.blocks),
    }


def disk_of(path: str) -> str | None:
    """Kernel name of the block device holding ``path`` (as in /proc/diskstats), or None."""
    try:
        dev = os.stat(path).st_dev
        return os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
    except OSError:
        return None


def disk_counters(name: str | None) -> dict | None:
    """/proc/diskstats counters of ``name``: bytes read/written and io_ticks (ms the device had I/O in flight)."""
    if not name:
        return None
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                if p[2] == name:
                    return {"read_bytes": int(p[5]) * 512, "write_bytes": int(p[9]) * 512, "busy_s": int(p[12]) / 1e3}
    except (OSError, IndexError, ValueError):
        pass
    return None


def timed_fuyou_step(eng: Engine, ids: torch.Tensor) -> tuple[float, dict, list[Span], float, float]:
    """One Fuyou step with a fresh timeline: (wall s, engine stats, spans, t0, t1).

    ``stats["bench_sys"]`` adds what the kernel saw meanwhile: the store disk's busy time
    (io_ticks, as iostat's %util) and bytes, this process's CPU seconds, other processes' CPU.
    """
    disk = disk_of(eng.store.dirs[0])
    eng.timeline.clear()
    d0, load = disk_counters(disk), ForeignLoad()
    t0 = time.perf_counter()
    st = eng.train_step(ids).to_json(io=False)  # the bytes: from the spans below
    t1 = time.perf_counter()
    d1, ld = disk_counters(disk), load.result()
    st["bench_sys"] = {
        "disk": disk,
        "own_cpu_s": ld["own_cpu_s"],
        "foreign_cores": ld["foreign_cores"],
        **({f"disk_{k}": d1[k] - d0[k] for k in d0} if d0 and d1 else {}),
    }
    return t1 - t0, st, list(eng.timeline.spans), t0, t1


def with_sys(ov: dict, st: dict) -> dict:
    """Add the kernel's view to one step's P1 figures: wall ÷ max(cpu union, disk busy), core saturation."""
    sysd = st.get("bench_sys", {})
    ov = {**ov, **{f"sys_{k}": v for k, v in sysd.items()}}
    if "disk_busy_s" in sysd:
        ov["p1_vs_disk_util"] = ov["wall_s"] / max(ov["busy_merged_s"]["cpu"], sysd["disk_busy_s"], 1e-9)
    ov["cpu_cores_used"] = sysd.get("own_cpu_s", 0.0) / ov["wall_s"]
    return ov


def code_version() -> dict:
    """The commit the engine code comes from, and whether fuyou/ has uncommitted changes."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "fuyou"], cwd=root, capture_output=True, text=True
            ).stdout.strip()
        )
        return {"commit": rev or None, "fuyou_dirty": dirty}
    except OSError:
        return {"commit": None, "fuyou_dirty": None}


# ---------------------------------------------------------------------------------- machine load
class ForeignLoad:
    """CPU seconds other processes used while this one ran (from /proc/stat and our own os.times()).

    The machine is shared; a figure taken while something else ran is marked by this number.
    """

    def __init__(self) -> None:
        self.busy0, self.own0, self.t0 = self._busy(), self._own(), time.perf_counter()

    @staticmethod
    def _busy() -> float:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return float("nan")
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        return time.process_time()  # user + system, all threads

    def result(self) -> dict:
        """{'wall_s', 'own_cpu_s', 'foreign_cpu_s', 'foreign_cores'} since construction."""
        wall = time.perf_counter() - self.t0
        own = self._own() - self.own0
        foreign = max(0.0, self._busy() - self.busy0 - own)
        return {"wall_s": wall, "own_cpu_s": own, "foreign_cpu_s": foreign, "foreign_cores": foreign / wall}


# ---------------------------------------------------------------------------------- P1 analysis
def _clip(spans: list[Span], t0: float, t1: float) -> list[tuple[str, str, float, float, int]]:
    return [(s.resource, s.label, max(s.t0, t0), min(s.t1, t1), s.nbytes) for s in spans if s.t1 > t0 and s.t0 < t1]


def _merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


SSD_GBPS = (1.7, 2.6)  # store read, write on this machine's disk (bench/RESULTS.md, P3); --ssd-gbps


def overlap(
    spans: list[Span], t0: float, t1: float, top_gaps: int = 5, ssd_gbps: tuple[float, float] = SSD_GBPS
) -> dict:
    """P1 figures of one step over [t0, t1]: raw (six resources) and merged (cpu, ssd), with gaps.

    A span on ``ssd_read``/``ssd_write`` runs from the request's issue to its completion, so it
    includes time queued behind other requests; ``ssd_floor_s`` is the time the bytes moved would
    take at the drive's measured bandwidth, and ``p1_vs_floor`` = wall ÷ max(cpu busy, that floor).
    """
    sp = _clip(spans, t0, t1)
    wall = t1 - t0
    raw = {r: union_length([(a, b) for res, _, a, b, _ in sp if res == r]) for r in RESOURCES}
    merged = {g: union_length([(a, b) for res, _, a, b, _ in sp if res in members]) for g, members in GROUPS.items()}
    any_busy = union_length([(a, b) for _, _, a, b, _ in sp])
    raw_b, merged_b = max(raw, key=raw.__getitem__), max(merged, key=merged.__getitem__)
    # idle gaps of the merged bottleneck, and what ran meanwhile
    busy_iv = _merge([(a, b) for res, _, a, b, _ in sp if res in GROUPS[merged_b]])
    edges = [t0] + [x for iv in busy_iv for x in iv] + [t1]
    gaps = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i + 1] - edges[i] > 0]
    gaps.sort(key=lambda g: g[0] - g[1])
    described = []
    for a, b in gaps[:top_gaps]:
        during = sorted({f"{res}:{lab}" for res, lab, x, y, _ in sp if x < b and y > a and res not in GROUPS[merged_b]})
        described.append(
            {"at_ms": round((a - t0) * 1e3, 1), "len_ms": round((b - a) * 1e3, 1), "in_flight": during[:8]}
        )
    rb = sum(n for res, *_, n in sp if res == "ssd_read")
    wb = sum(n for res, *_, n in sp if res == "ssd_write")
    floor = rb / (ssd_gbps[0] * 1e9) + wb / (ssd_gbps[1] * 1e9)
    return {
        "wall_s": wall,
        "ssd_floor_s": floor,
        "p1_vs_floor": wall / max(merged["cpu"], floor),
        "busy_s": raw,
        "bottleneck_raw": raw_b,
        "p1_raw": wall / raw[raw_b] if raw[raw_b] else float("inf"),
        "busy_merged_s": merged,
        "bottleneck_merged": merged_b,
        "p1_merged": wall / merged[merged_b] if merged[merged_b] else float("inf"),
        "idle_all_s": wall - any_busy,
        "bottleneck_idle_s": wall - merged[merged_b],
        "largest_gaps": described,
        "ssd_read_bytes": rb,
        "ssd_write_bytes": wb,
    }


def p1_summary(per_step: list[dict]) -> dict:
    """Medians over steps of the P1 figures, plus every repeat."""
    keys = [
        "wall_s",
        "p1_raw",
        "p1_merged",
        "idle_all_s",
        "bottleneck_idle_s",
        "ssd_floor_s",
        "p1_vs_floor",
        "cpu_cores_used",
        "sys_own_cpu_s",
        "sys_foreign_cores",
    ]
    keys += [
        k
        for k in ("p1_vs_disk_util", "sys_disk_busy_s", "sys_disk_read_bytes", "sys_disk_write_bytes")
        if all(k in d for d in per_step)
    ]
    med = {k: statistics.median(d[k] for d in per_step) for k in keys}
    busy = {r: statistics.median(d["busy_s"][r] for d in per_step) for r in RESOURCES}
    busy_m = {g: statistics.median(d["busy_merged_s"][g] for d in per_step) for g in GROUPS}
    ssd_bytes = statistics.median(d["ssd_read_bytes"] + d["ssd_write_bytes"] for d in per_step)
    return {
        **{f"{k}_median": v for k, v in med.items()},
        "busy_s_median": busy,
        "busy_merged_s_median": busy_m,
        "p1_raw_all": [d["p1_raw"] for d in per_step],
        "p1_merged_all": [d["p1_merged"] for d in per_step],
        "p1_vs_disk_util_all": [d.get("p1_vs_disk_util") for d in per_step],
        "foreign_cores_all": [d["sys_foreign_cores"] for d in per_step],
        "wall_s_all": [d["wall_s"] for d in per_step],
        "bottleneck_raw": per_step[len(per_step) // 2]["bottleneck_raw"],
        "bottleneck_merged": per_step[len(per_step) // 2]["bottleneck_merged"],
        "ssd_gbps_assumed": SSD_GBPS,
        "ssd_GBps_while_busy": ssd_bytes / busy_m["ssd"] / 1e9 if busy_m["ssd"] else None,
        "ssd_bytes_per_step": ssd_bytes,
        "largest_gaps_median_step": sorted(per_step, key=lambda d: d["wall_s"])[len(per_step) // 2]["largest_gaps"],
        "target": 1.10,
        "met_merged": med["p1_merged"] <= 1.10,
        "met_raw": med["p1_raw"] <= 1.10,
    }


# ---------------------------------------------------------------------------------- modes
def model_desc(a: argparse.Namespace, params: int) -> dict:
    return {
        "hidden": a.hidden,
        "layers": a.layers,
        "intermediate": a.inter,
        "heads": a.heads,
        "kv_heads": a.kv_heads,
        "vocab": a.vocab,
        "params": params,
        "experts": getattr(a, "experts", 0),
        "top_k": getattr(a, "top_k", 0),
        "batch": a.batch,
        "seq": a.seq,
        "tokens": a.batch * a.seq,
    }


def run_p2(a: argparse.Namespace, work: str, hw: dict) -> None:
    cfg = llama_config(a.hidden, a.layers, a.inter, a.heads, a.kv_heads, a.vocab, a.seq, a.experts, a.top_k)
    model = build_model(cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = n_params(model)
    ids = make_batch(a.vocab, a.batch, a.seq)
    ref = Reference(model, a.precision)
    desc = model_desc(a, params)
    for policy in a.policies.split(","):
        for threads in [int(x) for x in a.adam_threads.split(",")]:
            store = tempfile.mkdtemp(prefix="store-", dir=work)
            t_build = time.perf_counter()
            eng = fuyou_engine(
                cfg, sd, store, a.precision, policy, a.depth, threads or None, a.state_buffers, a.state_chunk,
                expert_groups=a.expert_groups,
            )  # fmt: skip
            t_build = time.perf_counter() - t_build
            plan = plan_desc(eng, policy, a.layers, threads)
            ref_t, fy_t, ref_loss, fy_loss, p1, ref_ld, fy_ld, ref_cpu, fy_cpu = ([] for _ in range(9))
            load = ForeignLoad()
            try:
                for rep in range(a.warmup + a.repeats):
                    ld = ForeignLoad()
                    t = time.perf_counter()
                    rl = ref.step(ids)
                    rt = time.perf_counter() - t
                    rld = ld.result()
                    ld = ForeignLoad()
                    ft, st, spans, t0, t1 = timed_fuyou_step(eng, ids)
                    fld = ld.result()
                    ref_loss.append(rl), fy_loss.append(st["loss"])
                    if rep >= a.warmup:
                        ref_t.append(rt), fy_t.append(ft)
                        ref_ld.append(rld["foreign_cores"]), fy_ld.append(fld["foreign_cores"])
                        ref_cpu.append(rld["own_cpu_s"]), fy_cpu.append(fld["own_cpu_s"])
                        p1.append(with_sys(overlap(spans, t0, t1), st))
            finally:
                eng.close()
                shutil.rmtree(store, ignore_errors=True)
            rm, fm = statistics.median(ref_t), statistics.median(fy_t)
            pairs = [f / r for f, r in zip(fy_t, ref_t)]
            quiet = [i for i in range(len(pairs)) if ref_ld[i] < a.quiet_cores and fy_ld[i] < a.quiet_cores]
            quiet_ratio = (
                statistics.median(fy_t[i] for i in quiet) / statistics.median(ref_t[i] for i in quiet)
                if quiet
                else None
            )
            common = {"precision": a.precision, "model": desc, "plan": plan, "smoke": a.smoke, "hardware": hw}
            emit(
                {
                    "bench": "engine_p2",
                    **common,
                    "ratio": fm / rm,
                    "target": 1.15,
                    "met": fm / rm <= 1.15,
                    "fuyou_step_s_median": fm,
                    "ref_step_s_median": rm,
                    "fuyou_step_s_all": fy_t,
                    "ref_step_s_all": ref_t,
                    "pair_ratios": pairs,
                    "pair_ratio_median": statistics.median(pairs),
                    "foreign_cores_ref": ref_ld,
                    "foreign_cores_fuyou": fy_ld,
                    "quiet_pairs": len(quiet),
                    "quiet_cores_threshold": a.quiet_cores,
                    "ratio_quiet_pairs": quiet_ratio,
                    "own_cpu_s_ref": ref_cpu,
                    "own_cpu_s_fuyou": fy_cpu,
                    "cpu_time_ratio_median": statistics.median(fy_cpu) / max(1e-9, statistics.median(ref_cpu)),
                    "fuyou_tokens_per_s": a.batch * a.seq / fm,
                    "ref_tokens_per_s": a.batch * a.seq / rm,
                    "ref_adamw": ref.adam_kind,
                    "ref_recipe": "fp32"
                    if a.precision == "fp32"
                    else "bf16 weights fwd/bwd + fp32 master, grads cast to fp32, AdamW on master, copied back",
                    "engine_build_s": t_build,
                    "repeats": a.repeats,
                    "warmup": a.warmup,
                    "machine_load": load.result(),
                    "loss_first_step": {"fuyou": fy_loss[0], "ref": ref_loss[0]},
                    "loss_all": {"fuyou": fy_loss, "ref": ref_loss},
                },
                a.out,
            )
            emit({"bench": "engine_p1", "setting": "compute-bound", **common, **p1_summary(p1)}, a.out)


def run_p1(a: argparse.Namespace, work: str, hw: dict) -> None:
    cfg = llama_config(a.hidden, a.layers, a.inter, a.heads, a.kv_heads, a.vocab, a.seq)
    model = build_model(cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = n_params(model)
    del model
    ids = make_batch(a.vocab, a.batch, a.seq)
    for policy in a.policies.split(","):
        for threads in [int(x) for x in a.adam_threads.split(",")]:
            store = tempfile.mkdtemp(prefix="store-", dir=work)
            eng = fuyou_engine(
                cfg, sd, store, a.precision, policy, a.depth, threads or None, a.state_buffers, a.state_chunk,
                expert_groups=a.expert_groups,
            )  # fmt: skip
            plan = plan_desc(eng, policy, a.layers, threads)
            per, losses = [], []
            load = ForeignLoad()
            try:
                for rep in range(a.warmup + a.repeats):
                    ft, st, spans, t0, t1 = timed_fuyou_step(eng, ids)
                    losses.append(st["loss"])
                    if rep >= a.warmup:
                        per.append(with_sys(overlap(spans, t0, t1), st))
            finally:
                eng.close()
                shutil.rmtree(store, ignore_errors=True)
            emit(
                {
                    "bench": "engine_p1",
                    "setting": a.setting,
                    "precision": a.precision,
                    "model": model_desc(a, params),
                    "plan": plan,
                    "smoke": a.smoke,
                    "hardware": hw,
                    **p1_summary(per),
                    "losses": losses,
                    "machine_load": load.result(),
                    "repeats": a.repeats,
                    "warmup": a.warmup,
                },
                a.out,
            )


def run_trace(a: argparse.Namespace, work: str, hw: dict) -> None:
    cfg = llama_config(a.hidden, a.layers, a.inter, a.heads, a.kv_heads, a.vocab, a.seq)
    model = build_model(cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = n_params(model)
    del model
    ids = make_batch(a.vocab, a.batch, a.seq)
    policy = a.policies.split(",")[0]
    threads = int(a.adam_threads.split(",")[0]) or None
    store = tempfile.mkdtemp(prefix="store-", dir=work)
    eng = fuyou_engine(cfg, sd, store, a.precision, policy, a.depth, threads, a.state_buffers, a.state_chunk)
    plan = plan_desc(eng, policy, a.layers, threads)
    load = ForeignLoad()
    try:
        for _ in range(a.warmup):
            eng.train_step(ids)
        ft, st, spans, t0, t1 = timed_fuyou_step(eng, ids)
        eng.timeline.to_chrome_trace(a.trace)
    finally:
        eng.close()
        shutil.rmtree(store, ignore_errors=True)
    ov = with_sys(overlap(spans, t0, t1, top_gaps=8), st)
    rows = {r: sum(1 for s in spans if s.resource == r) for r in RESOURCES}
    emit(
        {
            "bench": "engine_trace",
            "trace": a.trace,
            "trace_bytes": os.path.getsize(a.trace),
            "spans": len(spans),
            "spans_per_resource": rows,
            "precision": a.precision,
            "model": model_desc(a, params),
            "plan": plan,
            "loss": st["loss"],
            "step_s": ft,
            **ov,
            "machine_load": load.result(),
            "smoke": a.smoke,
            "hardware": hw,
        },
        a.out,
    )


PRESETS = {
    # compute-bound: ~166M params, 1024 tokens per step
    "p2": dict(hidden=1024, layers=8, inter=2816, heads=16, kv_heads=4, vocab=32000, batch=4, seq=256),
    # SSD-bound: large layers (~51M params each), 32 tokens per step
    "p1": dict(hidden=2048, layers=8, inter=5632, heads=16, kv_heads=16, vocab=32000, batch=1, seq=32),
    "trace": dict(hidden=1536, layers=4, inter=4096, heads=12, kv_heads=4, vocab=32000, batch=2, seq=256),
    "smoke": dict(hidden=64, layers=2, inter=128, heads=4, kv_heads=2, vocab=96, batch=2, seq=16),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("p2", "p1", "trace"), default="p2")
    ap.add_argument("--dir", default=None, help="store directory parent (default: a temp dir in /work or /tmp)")
    for k in ("hidden", "layers", "inter", "heads", "kv_heads", "vocab", "batch", "seq"):
        ap.add_argument(
            f"--{k.replace('_', '-')}", type=int, default=None, help="model/batch shape (default: per mode)"
        )
    ap.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="default: fp32 for p2, bf16 otherwise")
    ap.add_argument("--experts", type=int, default=0, help="p2: a Mixtral with this many experts per layer (0: Llama)")
    ap.add_argument("--top-k", type=int, default=2, help="p2 with --experts: experts per token")
    ap.add_argument(
        "--expert-groups",
        type=int,
        default=1,
        help="p2 with --experts: split each layer's experts into this many blocks",
    )
    ap.add_argument(
        "--policies", default=None, help="comma list of layer activation policies (keep,swap_cpu,recompute)"
    )
    ap.add_argument("--adam-threads", default="0", help="comma list of numba Adam thread counts; 0 = all cores")
    ap.add_argument("--depth", type=int, default=2, help="prefetch depth")
    ap.add_argument(
        "--state-buffers", type=int, default=2, help="Plan.state_buffers (optimizer-state chunks in flight)"
    )
    ap.add_argument("--state-chunk", type=int, default=None, help="Plan.state_chunk (elements; default: the plan's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--quiet-cores",
        type=float,
        default=0.05,
        help="a step counts as quiet if other processes used fewer cores than this meanwhile",
    )
    ap.add_argument("--setting", default="ssd-bound", help="label of the p1 setting")
    ap.add_argument("--trace", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_step.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 repeat, every mode; seconds")
    ap.add_argument("--out", default=None, help="also append JSON lines to this file")
    a = ap.parse_args()
    base = a.dir or ("/work" if os.path.isdir("/work") else tempfile.gettempdir())
    work = tempfile.mkdtemp(prefix="fuyou-bench-engine-", dir=base)
    hw = {**hardware_info([work]), "code": code_version()}
    try:
        if a.smoke:
            a.repeats, a.warmup = 1, 1
            trace_dest = a.trace
            for mode in ("p2", "p1", "trace"):
                b = argparse.Namespace(**vars(a))
                b.mode = mode
                _defaults(b, "smoke")
                if mode == "trace":
                    b.trace = (
                        os.path.join(work, "trace_smoke.json") if trace_dest == ap.get_default("trace") else trace_dest
                    )
                {"p2": run_p2, "p1": run_p1, "trace": run_trace}[mode](b, work, hw)
        else:
            _defaults(a, a.mode)
            {"p2": run_p2, "p1": run_p1, "trace": run_trace}[a.mode](a, work, hw)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _defaults(a: argparse.Namespace, preset: str) -> None:
    for k, v in PRESETS[preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.precision is None:
        a.precision = "fp32" if a.mode == "p2" else "bf16"
    if a.policies is None:
        a.policies = "keep,recompute" if a.mode == "p2" else "recompute"


if __name__ == "__main__":
    main()
