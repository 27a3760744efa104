"""``adamw_step``: the fused numba AdamW on flat torch tensors (validation, then one kernel call).

The kernel itself, and its numerics, are in ``numba_kernel.py``.

Threads: numba's ``workqueue`` threading layer aborts the process if two Python threads launch
parallel kernels at once, so every call goes through ``parallel.parallel_launch`` (``KERNEL_LOCK``
under that layer; nothing under the thread-safe ``omp``/``tbb``). In Fuyou the Adam worker thread
calls this kernel while the training thread runs the gradient norm's (see ``worker.py``). The
number of numba threads is per calling thread (``numba.set_num_threads``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from fuyou.errors import ConfigError
from fuyou.optim.args import AdamWHyper, step_coefficients
from fuyou.optim.buffers import as_numpy, check_buffers, check_int8_buffers, check_runs, check_split_buffers
from fuyou.optim.numba_kernel import (
    DEFAULT_CHUNK,
    INT8_BLOCK,
    INT8_CHUNK,
    adamw_int8_kernel,
    adamw_kernel,
    adamw_split_kernel,
    code_buckets,
)
from fuyou.optim.parallel import KERNEL_LOCK, parallel_launch
from fuyou.optim.quant8 import SIGNED_MAP, SIGNED_MID, UNSIGNED_MAP, UNSIGNED_MID

__all__ = ["KERNEL_LOCK", "adamw_int8_step", "adamw_split_step", "adamw_step"]

_NO_OUT = np.empty(0, dtype=np.uint16)
_TABLES = [SIGNED_MAP, UNSIGNED_MAP, *code_buckets(SIGNED_MID), *code_buckets(UNSIGNED_MID)]  # adamw_int8_kernel's


def adamw_step(
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
    chunk: int = DEFAULT_CHUNK,
) -> bool:
    """One AdamW step on flat CPU buffers with the numba kernel, in place; returns whether every new
    master value is finite (False: a non-finite gradient reached the update).

    Args:
        master: fp32 master weights [n], updated in place.
        m, v: first/second moments [n], fp32 or (small-state option) bf16, updated in place.
        grad: gradient [n], fp32 or bf16; read only.
        lr: learning rate of this step (schedules may change it every call).
        step: 1-based step count of this update, for the bias corrections.
        hyper: betas, eps and decoupled weight decay.
        grad_scale: multiplies the gradient inside the kernel (global-norm clipping coefficient).
        out: optional bf16 [n] buffer that receives the new weights, rounded to nearest even.
        chunk: elements per parallel task; the result does not depend on it.

    Raises:
        OptimBufferError: if a buffer has the wrong dtype, length, device or layout, or two overlap.
        ConfigError: if lr, step, grad_scale or chunk is invalid.
    """
    check_buffers(master, m, v, grad, out)
    arrays = [as_numpy(t) for t in (master, m, v, grad)] + [_NO_OUT if out is None else as_numpy(out)]
    return _launch(adamw_kernel, arrays, hyper, lr, step, grad_scale, chunk)


def _launch(
    kernel: Callable[..., bool], arrays: list[np.ndarray], hyper: AdamWHyper, lr: float, step: int,
    grad_scale: float, chunk: int,
) -> bool:  # fmt: skip
    """Run ``kernel`` over ``arrays`` with this step's float32 coefficients; whether every new master value
    is finite. Raises ConfigError for an invalid lr, step, grad_scale or chunk."""
    k = step_coefficients(hyper, lr, step, grad_scale)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"chunk={chunk!r} must be an int >= 1 (elements per parallel task)")
    if arrays[0].size == 0:
        return True
    with parallel_launch():
        finite = kernel(
            *arrays,
            k.decay, k.grad_scale, k.m_weight, k.beta2, k.v_weight, k.bc2_sqrt, k.eps,
            k.neg_step_size, chunk,
        )  # fmt: skip
    return bool(finite)


def adamw_split_step(
    rem: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    step: int,
    hyper: AdamWHyper = AdamWHyper(),
    grad_scale: float = 1.0,
    out: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
) -> bool:
    """One AdamW step on a split master (``fuyou.optim.split``) with the numba kernel, in place; returns
    whether every new master value is finite. Bit-identical to ``adamw_step`` on the decoded fp32 master.

    Args:
        rem: int16 remainders [n], updated in place.
        m, v: moments [n], fp32 or bf16; v's sign bits are the tie flags.
        grad: gradient [n], fp32 or bf16; read only.
        out: bf16 [n]: the old compute weights on entry, the new ones on return.
        lr, step, hyper, grad_scale, chunk: as ``adamw_step``.

    Raises:
        OptimBufferError: if a buffer has the wrong dtype, length, device or layout, or two overlap.
        ConfigError: if lr, step, grad_scale or chunk is invalid.
    """
    check_split_buffers(rem, m, v, grad, out)
    arrays = [as_numpy(t) for t in (rem, m, v, grad, out)]
    return _launch(adamw_split_kernel, arrays, hyper, lr, step, grad_scale, chunk)


def adamw_int8_step(
    rem_or_master: torch.Tensor,
    m_q: torch.Tensor,
    v_q: torch.Tensor,
    m_scale: torch.Tensor,
    v_scale: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    step: int,
    hyper: AdamWHyper = AdamWHyper(),
    grad_scale: float = 1.0,
    out: torch.Tensor | None,
    runs: Sequence[tuple[int, int, bool]],
    chunk: int = INT8_CHUNK,
) -> bool:
    """One AdamW step with 8-bit block-wise moments (``fuyou.optim.quant8``) with the numba kernel, in place;
    returns whether every new master value is finite. Bit-identical to ``quant8.adamw_int8_step_reference``.

    Args:
        rem_or_master: the split master's int16 remainders [n] (then ``out`` holds its bf16 weights), or the
            fp32 master [n] (then ``out=None``); updated in place.
        m_q, v_q: int8 / uint8 moment codes [n]; m_scale, v_scale: float32 scales [ceil(n/256)]; in place.
        grad: gradient [n], fp32 or bf16; read only.
        out: bf16 [n]: the old compute weights on entry, the new ones on return; None beside an fp32 master.
        runs: ``(a, z, decay)`` triples covering [0, n) in order; weight decay applies on the runs with
            ``decay`` true (the factor is exactly 1 elsewhere). Quantization blocks count from element 0.
        lr, step, hyper, grad_scale: as ``adamw_step``.
        chunk: elements per parallel task, a positive multiple of 256; the result does not depend on it.

    Raises:
        OptimBufferError: if a buffer has the wrong dtype, length, device or layout, two overlap, or the runs
            do not cover [0, n).
        ConfigError: if lr, step, grad_scale or chunk is invalid.
    """
    check_int8_buffers(rem_or_master, m_q, v_q, m_scale, v_scale, grad, out)
    starts, decayed = check_runs(runs, m_q.numel())
    if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1 and chunk % INT8_BLOCK:
        raise ConfigError(f"chunk={chunk!r} must be a multiple of {INT8_BLOCK} (whole quantization blocks per task)")
    arrays = [as_numpy(t) for t in (rem_or_master, m_q, v_q, m_scale, v_scale, grad)]
    arrays += [_NO_OUT if out is None else as_numpy(out), starts, decayed, *_TABLES]
    return _launch(adamw_int8_kernel, arrays, hyper, lr, step, grad_scale, chunk)
