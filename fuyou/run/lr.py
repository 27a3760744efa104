"""Learning-rate schedules, the same curves as ``transformers.get_scheduler``.

``constant`` (with optional linear warm-up: HF's ``constant_with_warmup``), ``linear`` (warm-up, then
linear decay to 0 at ``total`` steps) and ``cosine`` (warm-up, then half a cosine to 0).
"""

from __future__ import annotations

import math

from fuyou.errors import ConfigError

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(step: int, base: float, schedule: str, warmup: int, total: int) -> float:
    """Learning rate for the update with 0-based index ``step`` of ``total``.

    Raises ConfigError for an unknown schedule or negative warm-up.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"--lr-schedule must be one of {SCHEDULES}, got {schedule!r}")
    if warmup < 0:
        raise ConfigError(f"--warmup-steps must be ≥ 0, got {warmup}")
    if step < warmup:
        return base * step / max(1, warmup)
    if schedule == "constant":
        return base
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return base * max(0.0, (total - step) / max(1, total - warmup))
    return base * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
