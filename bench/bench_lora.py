"""LoRA on a frozen streamed base vs full fine-tuning of the same model, side by side in one run.

    python bench/bench_lora.py [--hidden 1024 --layers 8 --seq 256 --batch 4 --rank 16] [--freeze GLOB ...] [--smoke]

Three trainers on one random Llama and the same batches, each for ``--steps`` steps after
``--warmup``, interleaved step by step so drift hits all alike:

* ``fuyou_full``: Fuyou full fine-tuning (weights and Adam state stream from the store);
* ``fuyou_lora``: Fuyou LoRA (``--rank``, every linear layer): the base streams read-only;
* ``plain_lora``: ``peft`` + ``torch.optim.AdamW`` with the whole model in RAM (the reference);

and with ``--freeze``, partial full fine-tuning:

* ``fuyou_freeze``: Fuyou full fine-tuning with the parameters the globs name frozen (``--freeze``);
* ``plain_freeze``: the whole model in RAM with those parameters' ``requires_grad=False`` and AdamW.

Prints one JSON line per trainer (median step time, tokens/s, SSD bytes read and written per step)
and the ratios, and a Markdown table for ``bench/RESULTS.md`` on stderr. Clipping on (1.0, the CLI
default), fp32 unless ``--precision bf16``. ``--smoke``: a tiny model, two steps after one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.common import emit, hardware_info  # noqa: E402


def model(args: argparse.Namespace):
    """A random Llama of the arguments' shape (``bench_engine.llama_config``) and its config."""
    from transformers import LlamaForCausalLM

    from bench.bench_engine import llama_config

    heads = max(1, args.hidden // 64)
    cfg = llama_config(
        args.hidden, args.layers, args.hidden * 8 // 3 // 32 * 32, heads, max(1, heads // 2), args.vocab, args.seq
    )
    torch.manual_seed(0)
    return cfg, LlamaForCausalLM(cfg)


def engine(cfg, sd, d: str, args: argparse.Namespace, lora, freeze: tuple[str, ...] = ()):
    from fuyou.engine import Engine, EngineConfig

    os.makedirs(d)
    ec = EngineConfig(
        ssd_dirs=(d,),
        precision=args.precision,
        cpu_memory=args.cpu_memory,
        max_grad_norm=1.0,
        lr=1e-4,
        lora=lora,
        freeze=freeze,
    )
    return Engine.from_state_dict(cfg, sd, ec)


class PlainLora:
    """``peft`` + AdamW in RAM: the reference LoRA step."""

    def __init__(self, hf_model, settings) -> None:
        from peft import get_peft_model

        self.model = get_peft_model(hf_model, settings.peft_config())
        if settings and hf_model.dtype != torch.float32:
            for p in self.model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)

    def step(self, ids: torch.Tensor) -> dict:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return {"step_time_s": time.perf_counter() - t0, "ssd_read_bytes": 0, "ssd_write_bytes": 0, "loss": loss.item()}


class PlainFreeze(PlainLora):
    """The whole model in RAM, the parameters ``patterns`` name with ``requires_grad=False``, AdamW."""

    def __init__(self, hf_model, patterns: tuple[str, ...]) -> None:
        import fnmatch

        self.model = hf_model
        for name, p in hf_model.named_parameters():
            p.requires_grad_(not any(fnmatch.fnmatchcase(name, pat) for pat in patterns))
        self.params = [p for p in hf_model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--cpu-memory", default="4GiB")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    ap.add_argument("--freeze", action="append", default=[], help="also partial fine-tuning with this glob frozen")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, two steps after one")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.seq, args.batch, args.steps = 128, 2, 512, 32, 2, 2
    from fuyou.models.lora import LoraSettings

    settings = LoraSettings(rank=args.rank, alpha=2 * args.rank)
    cfg, hf = model(args)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(args.warmup + args.steps)]
    with tempfile.TemporaryDirectory(dir=args.dir) as base:
        import copy

        freeze = tuple(args.freeze)
        full = engine(cfg, sd, os.path.join(base, "full"), args, None)
        lora = engine(cfg, sd, os.path.join(base, "lora"), args, settings)
        fuyou = {"fuyou_full": full, "fuyou_lora": lora}
        if freeze:
            fuyou["fuyou_freeze"] = engine(cfg, sd, os.path.join(base, "freeze"), args, None, freeze)
        ref = hf.to(torch.bfloat16) if args.precision == "bf16" else hf
        plain = {"plain_lora": PlainLora(copy.deepcopy(ref) if freeze else ref, settings)}
        if freeze:
            plain["plain_freeze"] = PlainFreeze(ref, freeze)
        runs: dict[str, list[dict]] = {n: [] for n in [*fuyou, *plain]}
        try:
            for i, ids in enumerate(data):
                for name, eng in fuyou.items():
                    st = eng.train_step(ids)
                    if i >= args.warmup:
                        runs[name].append(st)
                for name, ref_step in plain.items():
                    st2 = ref_step.step(ids)
                    if i >= args.warmup:
                        runs[name].append(st2)
            for name in fuyou:  # each step's bytes, its update's included (read after the steps: the overlap kept)
                runs[name] = [st.to_json() for st in runs[name]]
            hw = hardware_info([base])
            tiers = {n: (e.plan.ram_weight_blocks, e.plan.ram_state_blocks) for n, e in fuyou.items()}
        finally:
            for eng in fuyou.values():
                eng.close()
        report(args, runs, hw, lora.lora.numel, sum(p.numel() for p in hf.parameters()), tiers)


def report(
    args: argparse.Namespace,
    runs: dict[str, list[dict]],
    hw: dict,
    lora_params: int,
    params: int,
    tiers: dict[str, tuple[int, int]],
) -> None:
    """Print each trainer's JSON line and the Markdown table; ``tiers``: each Fuyou trainer's RAM tier
    (blocks whose weights, and whose optimizer state, the host budget keeps in RAM: no SSD traffic)."""
    tokens = args.batch * args.seq
    med = {n: statistics.median(r["step_time_s"] for r in rs) for n, rs in runs.items()}
    rows = []
    for name, rs in runs.items():
        rec = {
            "bench": "lora",
            "trainer": name,
            "smoke": args.smoke,
            "hardware": hw,
            "params": params,
            "lora_params": lora_params,
            "rank": args.rank,
            "precision": args.precision,
            "tokens_per_step": tokens,
            "step_s_median": med[name],
            "step_s_all": [r["step_time_s"] for r in rs],
            "tokens_per_s": tokens / med[name],
            "ssd_read_bytes_per_step": statistics.median(r["ssd_read_bytes"] for r in rs),
            "ssd_write_bytes_per_step": statistics.median(r["ssd_write_bytes"] for r in rs),
            "vs_fuyou_full": med[name] / med["fuyou_full"],
            "vs_plain_lora": med[name] / med["plain_lora"],
            "freeze": list(args.freeze),
            "ram_tier_blocks": tiers.get(name),
        }
        if "plain_freeze" in med:
            rec["vs_plain_freeze"] = med[name] / med["plain_freeze"]
        emit(rec)
        rows.append(rec)
    table = [
        f"Llama hidden {args.hidden} × {args.layers} layers, vocab {args.vocab} ({params / 1e6:.1f} M params), "
        f"{args.batch} × {args.seq} tokens per step, {args.precision}, clipping 1.0, LoRA rank {args.rank} on every "
        f"linear layer ({lora_params / 1e6:.2f} M params)"
        + (f"; --freeze {' '.join(args.freeze)}" if args.freeze else "")
        + f"; median of {args.steps} steps after {args.warmup}, the trainers interleaved step by step\n",
        "| trainer | s/step | ÷ Fuyou full | ÷ plain peft |"
        + (" ÷ plain freeze |" if args.freeze else "")
        + " tokens/s | SSD read MB/step | SSD write MB/step | RAM tier (weights, state blocks) |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if args.freeze else ""),
    ]
    for r in rows:
        table.append(
            f"| {r['trainer']} | {r['step_s_median']:.2f} | {r['vs_fuyou_full']:.2f} | {r['vs_plain_lora']:.2f} | "
            + (f"{r['vs_plain_freeze']:.2f} | " if args.freeze else "")
            + f"{r['tokens_per_s']:.0f} | {r['ssd_read_bytes_per_step'] / 1e6:.1f} | "
            f"{r['ssd_write_bytes_per_step'] / 1e6:.1f} | {r['ram_tier_blocks'] or '—'} |"
        )
    print("\n".join(table), file=sys.stderr)


if __name__ == "__main__":
    main()
