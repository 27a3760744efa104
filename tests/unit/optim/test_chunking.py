"""Any chunking of a flat buffer gives a result bit-identical to the whole-buffer call."""

from __future__ import annotations

import pytest
import torch

from fuyou.optim import AdamWHyper, adamw_step

from .helpers import assert_bits_equal, make_grads, make_state

SIZES = [1, 7, 4097, (1 << 20) + 3]
HYPER = AdamWHyper(weight_decay=0.01)


def buffers(n: int, state_dtype: torch.dtype, grad_dtype: torch.dtype) -> list[torch.Tensor]:
    """(master, m, v, grad, out) after two warm-up steps, so m and v are not zero."""
    master, m, v = make_state(n, state_dtype)
    grads = make_grads(n, 3)
    for s in (1, 2):
        adamw_step(master, m, v, grads[s - 1].to(grad_dtype), lr=1e-3, step=s, hyper=HYPER)
    return [master, m, v, grads[2].to(grad_dtype), torch.empty(n, dtype=torch.bfloat16)]


def step_whole(bufs: list[torch.Tensor], chunk: int | None = None) -> None:
    kw = {} if chunk is None else {"chunk": chunk}
    adamw_step(*bufs[:4], out=bufs[4], lr=2e-3, step=3, hyper=HYPER, grad_scale=0.75, **kw)


def step_pieces(bufs: list[torch.Tensor], cuts: list[int]) -> None:
    """One call per piece [cuts[i], cuts[i+1]) of the flat buffers (views, no copies)."""
    for lo, hi in zip(cuts, cuts[1:]):
        piece = [t[lo:hi] for t in bufs]
        adamw_step(*piece[:4], out=piece[4], lr=2e-3, step=3, hyper=HYPER, grad_scale=0.75)


def odd_cuts(n: int) -> list[int]:
    """Cut points at unaligned offsets (1, 13, 4099, ...) so vector loops start mid-register."""
    inner = sorted({c for c in (1, 13, 100, 4099, 65_537, 524_291) if c < n})
    return [0, *inner, n]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(
    "state_dtype,grad_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_pieces_equal_whole(n: int, state_dtype: torch.dtype, grad_dtype: torch.dtype) -> None:
    whole = buffers(n, state_dtype, grad_dtype)
    pieces = [t.clone() for t in whole]
    step_whole(whole)
    step_pieces(pieces, odd_cuts(n))
    for name, a, b in zip(("master", "m", "v", "grad", "out"), whole, pieces):
        assert_bits_equal(a, b, name)


@pytest.mark.parametrize("chunk", [1, 5, 1000, 4096, 1 << 20])
def test_task_chunk_size_does_not_change_result(chunk: int) -> None:
    n = (1 << 20) + 3
    base = buffers(n, torch.float32, torch.bfloat16)
    other = [t.clone() for t in base]
    step_whole(base)
    step_whole(other, chunk=chunk)
    for name, a, b in zip(("master", "m", "v", "grad", "out"), base, other):
        assert_bits_equal(a, b, name)


def test_empty_buffers_are_a_no_op() -> None:
    e = torch.empty(0)
    adamw_step(e, e.clone(), e.clone(), e.clone(), lr=1e-3, step=1)
