"""``SplitLoss`` (the loss over an LM head split by vocabulary rows) against its plain reference,
``transformers``' ``ForCausalLMLoss`` over the whole head: the loss, the weight gradient of every
group and the hidden states' gradient, in fp32 and bf16, with ignored labels, uneven groups, chunks
smaller than a row of tokens and a soft cap."""

from __future__ import annotations

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from fuyou.engine.vocab_loss import IGNORE, SplitLoss, shifted
from fuyou.schedule.vocab import row_ranges


def _cap(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return torch.tanh(z / cap) * cap if cap else z


def _reference(h, w, labels, n_items, cap):
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    logits = _cap(h @ w.t(), cap)
    loss = ForCausalLMLoss(
        logits, None, w.shape[0], num_items_in_batch=n_items, shift_labels=shifted(labels).contiguous()
    )
    loss.backward()
    return loss.detach(), w.grad, h.grad


def _split(h, w, labels, n_items, cap, groups, chunk):
    parts = [w[lo:hi].detach().clone().requires_grad_() for lo, hi in row_ranges(w.shape[0], groups)]
    ranges = row_ranges(w.shape[0], groups)
    loss = SplitLoss(h.detach(), shifted(labels), n_items, chunk)
    for p, (lo, hi) in zip(parts, ranges):
        loss.forward_group(lambda x, p=p: _cap(x @ p.t(), cap), lo, hi)
    value = loss.loss()
    dh = torch.zeros(h.shape, dtype=torch.float32)
    for p, (lo, hi) in reversed(list(zip(parts, ranges))):
        loss.backward_group(lambda x, p=p: _cap(x @ p.t(), cap), lo, hi, dh)
    return value, torch.cat([p.grad for p in parts]), dh


@pytest.mark.parametrize(
    "dtype, groups, chunk, cap",
    [
        (torch.float32, 3, 1000, None),
        (torch.float32, 4, 3, 30.0),
        (torch.float32, 1, 7, None),
        (torch.bfloat16, 3, 5, None),
    ],
)
def test_split_loss_matches_the_whole_head(dtype, groups, chunk, cap):
    torch.manual_seed(0)
    b, t, hidden, vocab = 2, 9, 16, 50
    h = torch.randn(b, t, hidden).to(dtype)
    w = (torch.randn(vocab, hidden) * 0.5).to(dtype)
    labels = torch.randint(0, vocab, (b, t))
    labels[0, :3] = IGNORE
    n_items = int((shifted(labels) != IGNORE).sum())
    ref_loss, ref_dw, ref_dh = _reference(h, w, labels, n_items, cap)
    loss, dw, dh = _split(h, w, labels, n_items, cap, groups, chunk)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert float(loss) == pytest.approx(float(ref_loss), rel=tol)
    assert torch.allclose(dw.float(), ref_dw.float(), rtol=0, atol=tol * float(ref_dw.abs().max()))
    assert torch.allclose(dh, ref_dh.float(), rtol=0, atol=tol * float(ref_dh.abs().max()))


def test_a_micro_batch_without_labels_adds_nothing():
    h, w = torch.randn(1, 4, 8), torch.randn(10, 8)
    labels = torch.full((1, 4), IGNORE)
    loss = SplitLoss(h, shifted(labels), 5, 100)
    loss.forward_group(lambda x: x @ w.t(), 0, 10)
    assert float(loss.loss()) == 0.0
    dh = torch.zeros(1, 4, 8)
    loss.backward_group(lambda x: x @ w.t(), 0, 10, dh)
    assert not dh.any()
