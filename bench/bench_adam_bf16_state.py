"""Accuracy cost of bf16 Adam state (m, v in bf16) against fp32 state, on a real training curve.

A tiny Llama (``LlamaConfig`` built in code, random init, 1.3M params) learns byte-level language
modelling of real English text: the Python documentation topics shipped with the standard library
(``pydoc_data.topics``, ~466 KB; last 10 % held out). For each ``--beta2``, three runs from the
same initial weights, all updated by Fuyou's numba kernel (one flat buffer for all parameters):

- ``fp32``: fp32 m and v;
- ``bf16``: m and v stored in bf16 (rounded to nearest even after each fp32 update), same batches;
- ``fp32_reseed``: fp32 state, batches drawn with another seed: the run-to-run noise floor that
  the bf16-vs-fp32 difference should be compared with.

Train loss every step, held-out loss (all held-out text, non-overlapping windows) every
``--eval-every`` steps. JSON lines per evaluation and a summary per beta2.

    python bench/bench_adam_bf16_state.py                      # ~3 min on 2 cores: beta2 0.999
    python bench/bench_adam_bf16_state.py --beta2 0.999 0.95   # the figures in RESULTS-adam.md
    python bench/bench_adam_bf16_state.py --smoke              # seconds; what the tests run
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pydoc_data.topics  # noqa: E402

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench.common import emit, hardware_info  # noqa: E402
from fuyou.optim import AdamWHyper, adamw_step  # noqa: E402


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) byte tensors of the stdlib's documentation topics, 90/10 split."""
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    cut = int(len(data) * 0.9)
    return data[:cut], data[cut:]


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """A random-init Llama with a 256-byte vocabulary (seed 0, so every run starts the same)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).float()


class FlatAdamW:
    """All parameters as views into one flat fp32 master; the numba kernel updates it in place."""

    def __init__(self, model: torch.nn.Module, hyper: AdamWHyper, state_dtype: torch.dtype) -> None:
        self.params = list(model.parameters())
        n = sum(p.numel() for p in self.params)
        self.master, self.grad = torch.empty(n), torch.empty(n)
        self.m, self.v = torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
        offset = 0
        for p in self.params:
            view = self.master[offset : offset + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
            offset += p.numel()
        self.hyper, self.steps = hyper, 0

    def step(self, lr: float, watch: bool = False) -> dict[str, float]:
        """One update; with ``watch``, also the fraction of m and v elements (where the gradient
        is non-zero) that the update left bit-for-bit unchanged: with bf16 state, an increment
        below half a bf16 ulp is rounded away."""
        torch.cat([p.grad.reshape(-1) for p in self.params], out=self.grad)
        self.steps += 1
        before = (self.m.clone(), self.v.clone()) if watch else None
        adamw_step(self.master, self.m, self.v, self.grad, lr=lr, step=self.steps, hyper=self.hyper)
        for p in self.params:
            p.grad = None
        if before is None:
            return {}
        live = self.grad != 0
        same = [(a == b)[live].float().mean().item() for a, b in zip(before, (self.m, self.v))]
        return {"m_unchanged_frac": same[0], "v_unchanged_frac": same[1]}


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over 10 % of the steps, then cosine decay to 10 % of the peak."""
    warm = max(1, args.steps // 10)
    if step <= warm:
        return args.lr * step / warm
    t = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, val: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean next-byte cross-entropy (nats) over non-overlapping windows of the held-out text."""
    windows = val[: len(val) // args.seq * args.seq].view(-1, args.seq)[: args.max_eval_windows]
    losses = [model(input_ids=b, labels=b).loss.item() for b in windows.split(args.batch)]
    return statistics.fmean(losses)


def train(name: str, beta2: float, state_dtype: torch.dtype, data_seed: int,
          args: argparse.Namespace) -> dict:  # fmt: skip
    """One training run; returns its train-loss curve and held-out losses."""
    train_data, val = corpus()
    model = build_model(args)
    opt = FlatAdamW(model, AdamWHyper(beta1=0.9, beta2=beta2, weight_decay=0.01), state_dtype)
    gen = torch.Generator().manual_seed(data_seed)
    curve, heldout, t0 = [], {}, time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(train_data) - args.seq, (args.batch,), generator=gen)
        batch = torch.stack([train_data[s : s + args.seq] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        evaluate = step % args.eval_every == 0 or step == args.steps
        frozen = opt.step(lr_at(step, args), watch=evaluate)
        curve.append(loss.item())
        if evaluate:
            heldout[step] = heldout_loss(model, val, args)
            emit({"bench": "adam_bf16_state", "run": name, "beta2": beta2, "step": step,
                  "train_loss_last": curve[-1], "heldout_loss": heldout[step], **frozen,
                  "elapsed_s": time.perf_counter() - t0}, args.out)  # fmt: skip
    return {"curve": curve, "heldout": heldout, "frozen": frozen}


def smooth(curve: list[float], w: int) -> list[float]:
    """Trailing mean over ``w`` steps."""
    return [statistics.fmean(curve[max(0, i - w + 1) : i + 1]) for i in range(len(curve))]


def summarize(beta2: float, runs: dict[str, dict], args: argparse.Namespace) -> None:
    """Emit final losses per run and the bf16-vs-fp32 differences next to the reseed noise floor."""
    w = max(1, min(25, args.steps // 4))
    final = {k: statistics.fmean(r["curve"][-w:]) for k, r in runs.items()}
    held = {k: r["heldout"][args.steps] for k, r in runs.items()}
    sm = {k: smooth(r["curve"], w) for k, r in runs.items()}
    gap = max(abs(a - b) for a, b in zip(sm["bf16"], sm["fp32"]))
    noise = max(abs(a - b) for a, b in zip(sm["fp32_reseed"], sm["fp32"]))
    emit({"bench": "adam_bf16_state", "summary": True, "beta2": beta2, "steps": args.steps,
          "final_train_loss": final, "final_heldout_loss": held,
          "bf16_minus_fp32_train": final["bf16"] - final["fp32"],
          "bf16_minus_fp32_heldout": held["bf16"] - held["fp32"],
          "reseed_minus_fp32_train": final["fp32_reseed"] - final["fp32"],
          "reseed_minus_fp32_heldout": held["fp32_reseed"] - held["fp32"],
          "max_smoothed_curve_gap_bf16": gap, "max_smoothed_curve_gap_reseed": noise,
          "unchanged_in_last_step": {k: r["frozen"] for k, r in runs.items()},
          "smoothing_window": w}, args.out)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--beta2", type=float, nargs="+", default=[0.999])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=160)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-eval-windows", type=int, default=10_000)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 6 steps: seconds")
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.batch, args.seq, args.hidden, args.layers, args.heads = 6, 2, 32, 32, 1, 2
        args.eval_every, args.max_eval_windows = 3, 4
    n_params = sum(p.numel() for p in build_model(args).parameters())
    emit({"bench": "adam_bf16_state", "hardware": hardware_info(), "n_params": n_params,
          "args": vars(args)}, args.out)  # fmt: skip
    for beta2 in args.beta2:
        runs = {
            "fp32": train("fp32", beta2, torch.float32, 1, args),
            "bf16": train("bf16", beta2, torch.bfloat16, 1, args),
            "fp32_reseed": train("fp32_reseed", beta2, torch.float32, 2, args),
        }
        summarize(beta2, runs, args)


if __name__ == "__main__":
    main()
