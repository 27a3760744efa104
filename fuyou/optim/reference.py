"""The plain AdamW oracle: torch ops in float32, written to be read, not to be fast.

Same arguments and in-place semantics as ``adam_numba.adamw_step``. It mirrors the single-tensor
path of ``torch.optim.AdamW`` line by line, except that sqrt is correctly rounded (see
``_sqrt_exact``), with the two Fuyou extras made explicit: the gradient
scale (multiplied in before anything else) and bf16 storage (gradients widened to fp32; bf16 m and
v widened, updated in fp32, and rounded back with ``.to(torch.bfloat16)``).
"""

from __future__ import annotations

import torch

from fuyou.optim.args import AdamWHyper, check_step_args
from fuyou.optim.buffers import check_buffers


def _sqrt_exact(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt: via float64, exact by the double-rounding theorem for sqrt.

    ``torch.sqrt`` on float32 CPU tensors goes through MKL VML on MKL builds and is sometimes one
    ulp off (about 0.6 % of elements measured); the fused AdamW kernel and ours use the IEEE sqrt.
    """
    return x.double().sqrt_().float()


def adamw_step_reference(
    master: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    step: int,
    hyper: AdamWHyper = AdamWHyper(),
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> bool:
    """One AdamW step on flat CPU buffers with plain torch ops, in place; returns whether every new
    master value is finite.

    Arguments and units as ``adam_numba.adamw_step`` (lr per step, 1-based step, optional bf16
    ``out``).

    Raises:
        OptimBufferError: if a buffer has the wrong dtype, length, device or layout, or two overlap.
        ConfigError: if lr, step or grad_scale is invalid.
    """
    check_buffers(master, m, v, grad, out)
    check_step_args(lr, step, grad_scale)
    g = grad.float() * grad_scale if grad_scale != 1.0 else grad.float()
    exp_avg, exp_avg_sq = m.float(), v.float()  # copies when bf16; the tensors themselves if fp32
    master.mul_(1 - lr * hyper.weight_decay)
    exp_avg.lerp_(g, 1 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
    bias_correction1 = 1 - hyper.beta1**step
    bias_correction2 = 1 - hyper.beta2**step
    step_size = lr / bias_correction1
    denom = (_sqrt_exact(exp_avg_sq) / bias_correction2**0.5).add_(hyper.eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)
    if m.dtype != torch.float32:
        m.copy_(exp_avg.to(m.dtype))
        v.copy_(exp_avg_sq.to(v.dtype))
    if out is not None:
        out.copy_(master.to(torch.bfloat16))
    return bool(torch.isfinite(master).all())
