"""P4 — CPU Adam: params/s of the fused numba AdamW against torch fused and DeepSpeed, one run.

Cases, timed round-robin (one call of each per round, so drift hits all alike), median of
``--repeats`` after ``--warmup`` rounds, at each ``--sizes`` (flat fp32 parameters):

- ``numba_fuyou``: the Fuyou configuration: fp32 master, m, v in place, bf16 grad in, bf16 weight
  copy out. Bytes/param: read 4+4+4+2, write 4+4+4+2 = 28.
- ``numba_fp32grad_out``: fp32 grad in, bf16 copy out (30 B); ``numba_fp32grad``: fp32 grad, no
  copy (28 B) — the same work as the two baselines.
- ``torch_fused``: ``torch.optim.AdamW(fused=True)`` on one flat fp32 parameter (28 B).
- ``deepspeed``: ``DeepSpeedCPUAdam`` (adamw_mode, fp32) where it imports (``DS_ACCELERATOR=cpu``).
- ``copy``: memory bandwidth of a parallel copy of ``4*max(sizes)`` bytes, timed in the same
  rounds as each size's Adam cases, counting read + write bytes: a numba prange copy and
  ``torch.Tensor.copy_`` (both read each destination line before writing it, as a numpy copy
  does) and a numba copy with non-temporal stores (which does not). The P4 fraction is reported
  against the faster plain copy (the definition) and against the non-temporal copy.
- ``stream28``: the Adam access pattern without the arithmetic (read p, m, v, bf16 g; write p, m,
  v, bf16 out: 28 B/param): the bandwidth ceiling for this exact pattern.

One JSON line per case and size, then a summary per size with the P4 ratios.

    python bench/bench_adam.py                    # full run: 50M and 200M params, 7 repeats
    python bench/bench_adam.py --smoke            # seconds; what the tests run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import njit, prange  # noqa: E402

from bench.common import emit, hardware_info  # noqa: E402
from fuyou.optim import DEFAULT_CHUNK, AdamWHyper, adamw_step  # noqa: E402
from fuyou.optim.numba_kernel import nt_store_line, store_fence  # noqa: E402

HYPER = AdamWHyper(weight_decay=0.01)
LR = 1e-3
Case = Callable[[], None]


@njit(parallel=True, nogil=True, cache=True)
def _copy(dst, src, chunk):  # type: ignore[no-untyped-def]
    n = src.size
    for c in prange((n + chunk - 1) // chunk):
        lo, hi = c * chunk, min(c * chunk + chunk, n)
        d, s = dst[lo:hi], src[lo:hi]
        for i in range(hi - lo):
            d[i] = s[i]


@njit(parallel=True, nogil=True, cache=True)
def _copy_nt(dst, src, chunk):  # type: ignore[no-untyped-def]
    """uint16 copy with 64-byte non-temporal stores; 64-byte-aligned arrays, size % 32 == 0."""
    n = src.size
    for c in prange((n + chunk - 1) // chunk):
        for i in range(c * chunk, min(c * chunk + chunk, n), 32):
            nt_store_line(dst, i, src, i)
        store_fence()


@njit(parallel=True, nogil=True, cache=True)
def _stream28(p, m, v, g, out, chunk):  # type: ignore[no-untyped-def]
    n = p.size
    for c in prange((n + chunk - 1) // chunk):
        lo, hi = c * chunk, min(c * chunk + chunk, n)
        pp, mm, vv, gg, oo = p[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi], out[lo:hi]
        for i in range(hi - lo):
            pp[i] += np.float32(1.0)
            mm[i] += np.float32(1.0)
            vv[i] += np.float32(1.0)
            oo[i] = gg[i]


def numba_cases(n: int) -> tuple[dict[str, Case], dict[str, int]]:
    """The numba kernel in its three configurations plus stream28, sharing p, m, v buffers."""
    p, m = torch.randn(n), torch.randn(n) * 1e-4
    v = torch.rand(n) * 1e-8
    g32 = torch.randn(n) * 1e-3
    g16, out = g32.to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    def run(grad: torch.Tensor, o: torch.Tensor | None) -> Case:
        def call() -> None:
            step[0] += 1
            adamw_step(p, m, v, grad, lr=LR, step=step[0], hyper=HYPER, out=o)

        return call

    np_args = [t.numpy() for t in (p, m, v)] + [
        g16.view(torch.int16).numpy().view(np.uint16),
        out.view(torch.int16).numpy().view(np.uint16),
    ]
    cases = {
        "numba_fuyou": run(g16, out),
        "numba_fp32grad_out": run(g32, out),
        "numba_fp32grad": run(g32, None),
        "stream28": lambda: _stream28(*np_args, DEFAULT_CHUNK),
    }
    nbytes = {"numba_fuyou": 28, "numba_fp32grad_out": 30, "numba_fp32grad": 28, "stream28": 28}
    return cases, nbytes


def torch_fused_case(n: int) -> Case:
    """torch.optim.AdamW(fused=True) on one flat fp32 parameter with an fp32 gradient."""
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-3
    opt = torch.optim.AdamW([p], lr=LR, weight_decay=HYPER.weight_decay, fused=True)
    return lambda: opt.step()


def deepspeed_case(n: int) -> tuple[Case | None, str]:
    """DeepSpeedCPUAdam (AdamW mode, fp32 state), or (None, why not)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as err:  # noqa: BLE001 - any import/build failure is a recorded note
        return None, f"deepspeed unavailable: {type(err).__name__}: {err}"[:300]
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-3
    try:
        opt = DeepSpeedCPUAdam([p], lr=LR, weight_decay=HYPER.weight_decay, adamw_mode=True)
    except Exception as err:  # noqa: BLE001
        return None, f"DeepSpeedCPUAdam failed to build: {type(err).__name__}: {err}"[:300]
    import deepspeed

    return (lambda: opt.step()), f"deepspeed {deepspeed.__version__}"


def copy_cases(nbytes: int) -> dict[str, Case]:
    """Parallel copies of ``nbytes`` bytes: numba prange loop, torch copy_, numba NT stores."""
    src = torch.rand(nbytes // 128 * 32)
    dst = torch.empty_like(src)
    s, d = src.numpy(), dst.numpy()
    s16, d16 = s.view(np.uint16), d.view(np.uint16)
    return {
        "copy_numba": lambda: _copy(d, s, 1 << 16),
        "copy_torch": lambda: dst.copy_(src),
        "copy_numba_nt": lambda: _copy_nt(d16, s16, 1 << 17),
    }


def round_robin(cases: dict[str, Case], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Time each case once per round; return per-case timings (seconds) after the warm-up rounds."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(warmup + repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def bench_size(n: int, args: argparse.Namespace, copies: dict[str, Case], copy_nbytes: int) -> None:
    """Run the Adam cases at ``n`` parameters and the copies in one round-robin; emit the lines."""
    cases, nbytes = numba_cases(n)
    cases["torch_fused"], nbytes["torch_fused"] = torch_fused_case(n), 28
    ds, ds_note = (None, "skipped (--no-deepspeed)") if args.no_deepspeed else deepspeed_case(n)
    if ds is not None:
        cases["deepspeed"], nbytes["deepspeed"] = ds, 28
    times = round_robin({**cases, **copies}, args.repeats, args.warmup)
    gbps = {k: 2 * copy_nbytes / statistics.median(times.pop(k)) / 1e9 for k in copies}
    for name, value in gbps.items():
        emit({"bench": "adam", "case": name, "n_params": n, "nbytes": copy_nbytes,
              "GBps": value, "accounting": "read + write bytes"}, args.out)  # fmt: skip
    rate = {k: n / statistics.median(ts) for k, ts in times.items()}
    for name, ts in times.items():
        emit({"bench": "adam", "case": name, "n_params": n, "median_s": statistics.median(ts),
              "Gparams_per_s": rate[name] / 1e9, "bytes_per_param": nbytes[name],
              "GBps": rate[name] * nbytes[name] / 1e9, "times_s": ts}, args.out)  # fmt: skip
    copy = {"plain": max(gbps["copy_numba"], gbps["copy_torch"]), "nt": gbps["copy_numba_nt"]}
    summarize(n, times, rate, copy, ds_note, args)


def summarize(n: int, times: dict[str, list[float]], rate: dict[str, float],
              copy: dict[str, float], ds_note: str, args: argparse.Namespace) -> None:  # fmt: skip
    """Emit the P4 ratios for one size."""
    base = [k for k in ("torch_fused", "deepspeed") if k in rate]
    best = max(base, key=rate.__getitem__)
    per_round = [min(times[k][i] for k in base) / t for i, t in enumerate(times["numba_fuyou"])]
    fuyou_gbps = rate["numba_fuyou"] * 28 / 1e9
    emit({"bench": "adam", "summary": True, "n_params": n, "deepspeed": ds_note,
          "numba_fuyou_Gparams_per_s": rate["numba_fuyou"] / 1e9, "best_baseline": best,
          "best_baseline_Gparams_per_s": rate[best] / 1e9,
          "ratio_vs_best": rate["numba_fuyou"] / rate[best],
          "ratio_vs_best_per_round_median": statistics.median(per_round),
          "ratio_fp32grad_vs_best": rate["numba_fp32grad"] / rate[best],
          "GBps_at_28B": fuyou_gbps, "copy_GBps": copy["plain"], "copy_nt_GBps": copy["nt"],
          "fraction_of_copy_bw": fuyou_gbps / copy["plain"],
          "fraction_of_copy_nt_bw": fuyou_gbps / copy["nt"],
          "fraction_of_stream28": rate["numba_fuyou"] / rate["stream28"],
          "target_ratio_met": rate["numba_fuyou"] >= rate[best],
          "target_bw_met": fuyou_gbps >= 0.8 * copy["plain"]}, args.out)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[50_000_000, 200_000_000])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repeat, no DeepSpeed")
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.repeats, args.warmup, args.no_deepspeed = [100_003], 1, 1, True
    emit({"bench": "adam", "hardware": hardware_info(), "numba": numba.__version__,
          "numba_threads": numba.get_num_threads(), "torch_threads": torch.get_num_threads(),
          "chunk": DEFAULT_CHUNK, "sizes": args.sizes, "repeats": args.repeats,
          "warmup": args.warmup, "loadavg_start": os.getloadavg()}, args.out)  # fmt: skip
    copy_nbytes = 4 * max(args.sizes) // 128 * 128
    copies = copy_cases(copy_nbytes)
    for n in args.sizes:
        bench_size(n, args, copies, copy_nbytes)
    emit({"bench": "adam", "numba_threading_layer": numba.threading_layer(),
          "loadavg_end": os.getloadavg()}, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
