"""``--precision auto``: bf16 where the device computes it fast, fp32 where it does not.

GPUs since Ampere and CPUs with AVX-512 BF16 or AMX run bf16 matmuls at least as fast as fp32; CPUs
with AVX2 only (AMD Zen 1–3, older Xeons) emulate them, ~50× slower than fp32 (a 49152 × 576 LM head
at 256 tokens: 14.2 s in bf16, 0.28 s in fp32 on a Zen 3 core pair). The decision is measured, not
read from CPU flags: a bf16 and an fp32 matmul of one linear layer's shape are timed on the device
(about a second on the slowest CPU, milliseconds elsewhere) and the ratio is cached per machine
(``fuyou.machine``). ``auto`` picks fp32 when bf16 is more than ``SLOW_FACTOR`` times slower.

fp32 compute keeps everything in fp32, the SSD weight copy included (4 B/param instead of 2): exact,
and on the CPUs that need it the model is small enough that the extra SSD bytes do not matter.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fuyou.device.base import Backend
from fuyou.errors import ConfigError

SLOW_FACTOR = 1.5
"""bf16 matmul time ÷ fp32 time above which ``auto`` computes in fp32."""
PROBE_SHAPE = (128, 512, 512)
"""(tokens, in, out) of the probe matmul: 67 MFLOP, ~0.2 s in emulated bf16."""
PRECISIONS = ("auto", "bf16", "fp32")
AUTO_ENV = "FUYOU_AUTO_PRECISION"
"""Set to ``bf16`` or ``fp32``, what ``auto`` resolves to without measuring: to run the tests as the other
kind of CPU would (``python -m pytest --auto-precision fp32``), or to pin a fleet's choice."""


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run computes in and why."""

    precision: str
    """``bf16`` or ``fp32``."""
    requested: str
    """What the user asked for: ``auto``, ``bf16`` or ``fp32``."""
    bf16_slowdown: float | None
    """Measured bf16 ÷ fp32 matmul time on this device (None: not measured)."""
    reason: str

    def to_json(self) -> dict:
        """For run.json."""
        return {
            "precision": self.precision,
            "requested": self.requested,
            "bf16_slowdown": self.bf16_slowdown,
            "reason": self.reason,
        }


def _matmul_timer(backend: Backend, dtype: torch.dtype) -> Callable[[], float]:
    """A function timing one probe matmul in ``dtype`` on the backend's device (seconds)."""
    m, k, n = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(backend.device, dtype)
    b = torch.randn(k, n, generator=gen).to(backend.device, dtype)

    def once() -> float:
        t0 = time.perf_counter()
        a @ b
        backend.synchronize()
        return time.perf_counter() - t0

    return once


def measure_bf16_slowdown(backend: Backend, repeats: int = 5) -> float:
    """bf16 ÷ fp32 time of the probe matmul on ``backend``'s device (uncached; ~1 s at worst).

    The two dtypes are timed in alternation after a warm-up of each, and each keeps its fastest of
    ``repeats``: a busy moment of a shared machine only slows a matmul, and alternating keeps one such
    moment from landing on one dtype alone (one did once, and auto chose fp32 on a CPU where bf16 ran
    at 0.4× of fp32's time; the verdict is cached for every later run).
    """
    bf16, fp32 = _matmul_timer(backend, torch.bfloat16), _matmul_timer(backend, torch.float32)
    bf16(), fp32()
    times = [(bf16(), fp32()) for _ in range(repeats)]
    return min(t[0] for t in times) / max(min(t[1] for t in times), 1e-9)


def bf16_slowdown(backend: Backend) -> tuple[float, bool]:
    """(bf16 ÷ fp32 matmul time on this device, whether it came from the per-machine cache)."""
    from fuyou.machine import cached, machine_key

    key = machine_key(backend.name + ":" + backend.describe())
    value, hit = cached("bf16-speed", key, lambda: measure_bf16_slowdown(backend))
    return float(value), hit


def choose_precision(requested: str, backend: Backend) -> PrecisionChoice:
    """Resolve ``--precision`` for ``backend``: ``auto`` → bf16 or fp32 by the measured slowdown (or as
    ``$FUYOU_AUTO_PRECISION`` says).

    An explicit ``bf16`` on a device where bf16 is slow is kept; the reason says how much slower it
    measured (callers warn with it). Raises ConfigError for an unknown value.
    """
    if requested not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {requested!r}")
    if requested == "fp32":
        return PrecisionChoice("fp32", requested, None, "fp32 asked for")
    forced = os.environ.get(AUTO_ENV, "")
    if requested == "auto" and forced:
        if forced not in ("bf16", "fp32"):
            raise ConfigError(f"{AUTO_ENV} must be bf16 or fp32, got {forced!r}; unset it to measure")
        return PrecisionChoice(forced, requested, None, f"auto: {forced}, as {AUTO_ENV} says")
    factor, _ = bf16_slowdown(backend)
    slow = factor > SLOW_FACTOR
    where = f"bf16 matmul measured {factor:.1f}× the time of fp32 on this {backend.name.upper()}"
    if requested == "bf16":
        reason = (
            f"bf16 asked for; {where}: --precision fp32 (or auto) would compute faster" if slow else "bf16 asked for"
        )
        return PrecisionChoice("bf16", requested, factor, reason)
    return PrecisionChoice(
        "fp32" if slow else "bf16", requested, factor, f"auto: {where}, so {'fp32' if slow else 'bf16'}"
    )
