"""AdamW hyper-parameters, their validation, and the per-step float32 coefficients.

Both the reference and the numba kernel take the same arguments and derive the same coefficients
here, in the order ``torch.optim.AdamW`` (single-tensor path) uses: Python floats (float64) for the
bias corrections, then one cast to float32 per coefficient, as ATen does when a Python scalar meets
a float32 tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fuyou.errors import ConfigError


@dataclass(frozen=True)
class AdamWHyper:
    """The AdamW settings that stay fixed across steps (lr and step come with each call)."""

    beta1: float = 0.9
    """Decay of the first moment (m); 0 <= beta1 < 1."""
    beta2: float = 0.999
    """Decay of the second moment (v); 0 <= beta2 < 1."""
    eps: float = 1e-8
    """Added to sqrt(v̂) in the denominator; > 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay per unit of lr (p *= 1 - lr * weight_decay); >= 0."""

    def __post_init__(self) -> None:
        check_hyper(self.beta1, self.beta2, self.eps, self.weight_decay)


def check_hyper(beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """Validate the fixed AdamW settings.

    Raises:
        ConfigError: naming every invalid value at once.
    """
    problems = []
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not (0.0 <= beta < 1.0):
            problems.append(f"{name}={beta!r} must be in [0, 1)")
    if not (math.isfinite(eps) and eps > 0.0):
        problems.append(f"eps={eps!r} must be a finite number > 0")
    if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
        problems.append(f"weight_decay={weight_decay!r} must be a finite number >= 0")
    if problems:
        raise ConfigError("invalid AdamW settings: " + "; ".join(problems))


def check_step_args(lr: float, step: int, grad_scale: float) -> None:
    """Validate the per-call AdamW arguments.

    Raises:
        ConfigError: if lr is negative or not finite, step is not an int >= 1 (it is 1-based: the
            first update uses step=1), or grad_scale is negative or not finite.
    """
    problems = []
    if not (math.isfinite(lr) and lr >= 0.0):
        problems.append(f"lr={lr!r} must be a finite number >= 0")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        problems.append(f"step={step!r} must be an int >= 1 (1-based; the first update is step 1)")
    if not (math.isfinite(grad_scale) and grad_scale >= 0.0):
        problems.append(f"grad_scale={grad_scale!r} must be a finite number >= 0")
    if problems:
        raise ConfigError("invalid AdamW step arguments: " + "; ".join(problems))


@dataclass(frozen=True)
class StepCoefficients:
    """The float32 scalars one AdamW step multiplies with (what the kernel receives)."""

    decay: np.float32
    """1 - lr * weight_decay: the master weight is multiplied by it first."""
    grad_scale: np.float32
    """Multiplies every gradient element (clipping coefficient; 1 = unchanged)."""
    m_weight: np.float32
    """1 - beta1: the lerp weight of the new gradient in m."""
    beta2: np.float32
    """beta2: v is multiplied by it."""
    v_weight: np.float32
    """1 - beta2: multiplies g*g when added to v."""
    bc2_sqrt: np.float32
    """sqrt(1 - beta2**step): sqrt(v) is divided by it."""
    eps: np.float32
    """Added to the bias-corrected sqrt(v)."""
    neg_step_size: np.float32
    """-lr / (1 - beta1**step): multiplies m in the update."""


def step_coefficients(hyper: AdamWHyper, lr: float, step: int, grad_scale: float = 1.0) -> StepCoefficients:
    """Derive one step's float32 coefficients exactly as torch's single-tensor AdamW does.

    Raises:
        ConfigError: if lr, step or grad_scale is invalid (see ``check_step_args``).
    """
    check_step_args(lr, step, grad_scale)
    f32 = np.float32
    bias_correction1 = 1 - hyper.beta1**step
    bias_correction2 = 1 - hyper.beta2**step
    return StepCoefficients(
        decay=f32(1 - lr * hyper.weight_decay),
        grad_scale=f32(grad_scale),
        m_weight=f32(1 - hyper.beta1),
        beta2=f32(hyper.beta2),
        v_weight=f32(1 - hyper.beta2),
        bc2_sqrt=f32(bias_correction2**0.5),
        eps=f32(hyper.eps),
        neg_step_size=f32(-(lr / bias_correction1)),
    )
