"""The turnaround: the head's forward, the loss and the head's backward, between a step's forward
and its backward — and the same head's loss alone for an evaluation. Two variants, chosen once with
the model (``for_adapter``):

* ``WholeHead`` — the head is one block (with a tied embedding, plus the block it borrows): per
  micro-batch and, within one, per chunk of ``sizing.loss_chunk_tokens`` tokens, logits, loss and
  backward at once, so logits never pile up.
* ``SplitHead`` — the head is split by vocabulary rows into blocks F…H (``fuyou.schedule.vocab``): a
  forward pass over the groups folds each group's logits into a running log-sum-exp, a backward pass
  over them in reverse (H still resident, the others read again: ``rules.load_order``) recomputes them
  and makes their gradients (``fuyou.engine.vocab_loss``); each group's gradient is handed off as its
  backward ends, the first group's (with the final norm's) last.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from fuyou.engine.vocab_loss import SplitLoss, shifted
from fuyou.models.adapters import Adapter
from fuyou.models.store_layout import elem_size
from fuyou.schedule.sizing import loss_chunk_tokens

if TYPE_CHECKING:
    from fuyou.engine.step import StepRunner, StepState

Bind = Callable[[int], object]
"""Evaluation: make the adapter use block ``b``'s weights (the loader's next block)."""


class WholeHead:
    """The head as one block; see the module docstring."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.head = self.first = len(adapter.blocks) - 1

    def run(self, r: StepRunner, st: StepState) -> None:
        """Head forward, loss and head backward of every micro-batch; leaves the gradients of the
        head's inputs in ``st.xs`` and hands the head's gradient off."""
        c, H = r.c, self.head
        st.weights[H] = r.load(st, H)
        borrowed = {o: r.load(st, o) for o in r.borrowed()}
        st.params[H] = r.bind(st, H, borrowed)
        if r.gets_gradients(H):
            r.attach_grads(st, H)
        with r.computing("head fwd+bwd", "the head's loss"):
            st.xs = [self._loss(r, st, k, x) for k, x in enumerate(st.xs)]
        r.drop_params(st, H)
        del borrowed
        st.weights.pop(H)
        if r.gets_gradients(H) and c.layout.trains(H):
            r.hand_off(st, H)

    def _loss(self, r: StepRunner, st: StepState, k: int, x: torch.Tensor) -> torch.Tensor:
        """Loss of micro-batch ``k`` (``[b, t, hidden]`` into the head) token chunk by token chunk, each
        chunk's backward run at once; returns the gradient of ``x``. The loss is summed over labelled
        tokens and divided by the step's count (``transformers``' ``num_items_in_batch`` loss)."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        c, H = r.c, self.head
        vocab = self.adapter.config.vocab_size
        tokens = loss_chunk_tokens(vocab, elem_size(c.layout.compute_dtype), c.backend.memory().capacity)
        shift = shifted(st.labels[k])
        n_items: Any = st.num_items  # transformers annotates it as a Tensor; it divides by it, an int works
        pieces = [p.requires_grad_() for p in x.detach().split(max(1, tokens // x.shape[0]), dim=1)]
        start = 0
        for piece in pieces:
            stop = start + piece.shape[1]
            with torch.enable_grad():
                logits, _ = self.adapter.forward(H, piece, st.ctxs[k])
                loss = ForCausalLMLoss(
                    logits, None, vocab, num_items_in_batch=n_items, shift_labels=shift[:, start:stop].contiguous()
                )
            loss.backward()
            st.loss_sum = st.loss_sum + loss.detach().double()  # no device→host read per micro-batch
            start = stop
        return torch.cat([p.grad for p in pieces], dim=1) if len(pieces) > 1 else pieces[0].grad

    def evaluate(self, bind: Bind, x: torch.Tensor, ctx: Any, labels: torch.Tensor, device_bytes: int) -> torch.Tensor:
        """Σ of the head's loss over ``x``'s labelled tokens (``labels`` shifted: ``vocab_loss.shifted``),
        not divided (a device scalar), ``sizing.loss_chunk_tokens`` at a time under ``device_bytes`` (0:
        no budget); ``bind`` binds the head (and what it borrows)."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        bind(self.head)
        vocab = self.adapter.config.vocab_size
        step = max(1, loss_chunk_tokens(vocab, x.element_size(), device_bytes) // x.shape[0])
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        one: Any = 1  # transformers annotates it as a Tensor; it divides by it, an int works
        for piece, lab in zip(x.split(step, dim=1), labels.split(step, dim=1)):
            logits, _ = self.adapter.forward(self.head, piece, ctx)
            total += ForCausalLMLoss(logits, None, vocab, num_items_in_batch=one, shift_labels=lab.contiguous())
        self.adapter.unbind(self.head)
        return total


class SplitHead:
    """The head split by vocabulary rows; see the module docstring."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.first, self.last = adapter.first_head, len(adapter.blocks) - 1

    def _chunk(self, b: int, compute_bytes: int, device_bytes: int) -> int:
        lo, hi = self.adapter.head_rows[b]
        return loss_chunk_tokens(hi - lo, compute_bytes, device_bytes)

    def _logits(self, b: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return partial(self.adapter.logits, b)

    def run(self, r: StepRunner, st: StepState) -> None:
        """The two passes over the head's groups (module docstring); leaves the gradients of the head's
        inputs in ``st.xs`` and hands each group's gradient off as its backward ends."""
        c, F, H = r.c, self.first, self.last
        rows, cb, cap = self.adapter.head_rows, elem_size(c.layout.compute_dtype), c.backend.memory().capacity
        losses: list[SplitLoss] = []
        for b in range(F, H + 1):
            st.weights[b] = r.load(st, b)
            st.params[b] = r.bind(st, b)
            name = c.layout.blocks[b].name
            with r.computing(f"fwd {name}", f"the loss's forward by {name}"), torch.no_grad():
                if b == F:
                    chunk = self._chunk(b, cb, cap)
                    losses = [
                        SplitLoss(self.adapter.final_norm(x), shifted(st.labels[k]), st.num_items, chunk)
                        for k, x in enumerate(st.xs)
                    ]
                for loss in losses:
                    loss.forward_group(self._logits(b), *rows[b])
                if b == H:
                    for loss in losses:
                        st.loss_sum = st.loss_sum + loss.loss().double()
            if b < H:  # read again for the backward pass; the last group stays
                r.drop_params(st, b)
                st.weights.pop(b)
        dhn = [torch.zeros(loss.hn.shape, dtype=torch.float32, device=loss.hn.device) for loss in losses]
        for b in range(H, F - 1, -1):
            if b < H:
                st.weights[b] = r.load(st, b)
                st.params[b] = r.bind(st, b)
            if r.gets_gradients(b):
                r.attach_grads(st, b)
            name = c.layout.blocks[b].name
            with r.computing(f"bwd {name}", f"the loss's backward by {name}"):
                for loss, d in zip(losses, dhn):
                    loss.backward_group(self._logits(b), *rows[b], d)
                if b == F:
                    del losses
                    st.xs = [self._norm_backward(x, d) for x, d in zip(st.xs, dhn)]
            r.drop_params(st, b)
            st.weights.pop(b)
            if r.gets_gradients(b) and c.layout.trains(b):
                r.hand_off(st, b)

    def _norm_backward(self, x: torch.Tensor, dhn: torch.Tensor) -> torch.Tensor:
        """The gradient of the head's input ``x`` through the final norm (recomputed), given the normed
        states' ``dhn``; the norm's weight gradient lands in the first group's buffer."""
        xr = x.detach().requires_grad_()
        with torch.enable_grad():
            hn = self.adapter.final_norm(xr)
        hn.backward(dhn.to(hn.dtype))
        assert xr.grad is not None
        return xr.grad

    def evaluate(self, bind: Bind, x: torch.Tensor, ctx: Any, labels: torch.Tensor, device_bytes: int) -> torch.Tensor:
        """Σ of the head's loss over ``x``'s labelled tokens (forward pass only; ``bind`` binds each
        group in turn, the loader's order), not divided (a device scalar)."""
        del ctx  # the head needs no micro-batch context
        loss: SplitLoss | None = None
        rows = self.adapter.head_rows
        for b in range(self.first, self.last + 1):
            bind(b)
            with torch.no_grad():
                if loss is None:
                    chunk = self._chunk(b, x.element_size(), device_bytes)
                    loss = SplitLoss(self.adapter.final_norm(x), labels, 1, chunk)
                loss.forward_group(self._logits(b), *rows[b])
            self.adapter.unbind(b)
        assert loss is not None
        return loss.loss().double()


def for_adapter(adapter: Adapter) -> WholeHead | SplitHead:
    """The turnaround of ``adapter``'s model: ``SplitHead`` when its head is split by vocabulary rows."""
    return SplitHead(adapter) if adapter.head_rows else WholeHead(adapter)
