"""The causal-LM loss over an LM head split by vocabulary rows (``fuyou.schedule.vocab``), one
micro-batch at a time: a forward pass over the head's groups that keeps, per token, a running
log-sum-exp and the label's logit (never the logits), and a backward pass over the groups that
recomputes each group's logits and feeds autograd their gradient, the softmax minus the one-hot label.

It is ``transformers``' ``ForCausalLMLoss`` (cross-entropy in fp32, summed over labelled tokens and
divided by ``num_items_in_batch``; ``-100`` ignored) taken a group of rows at a time; the values agree
with it up to fp32 rounding of the log-sum-exp. The plain reference the tests hold it against is that
function over the unsplit head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

IGNORE = -100
"""Label of a token that does not count (``transformers``' ``ignore_index``)."""

Logits = Callable[[torch.Tensor], torch.Tensor]
"""A head group's logits (``[b, c, rows]``) of normed hidden states (``[b, c, hidden]``)."""


class SplitLoss:
    """The loss of one micro-batch over a split head.

    ``hn``: the normed hidden states (``[b, t, hidden]``, no graph); ``labels``: each token's label,
    already shifted (token i's is label i + 1; ``[b, t]``, ``IGNORE`` where none); ``num_items``: the
    step's labelled tokens (an int, or a tensor on the device); ``chunk``: tokens whose logits one
    group computes at once (``sizing.loss_chunk_tokens`` of the group's rows)."""

    def __init__(self, hn: torch.Tensor, labels: torch.Tensor, num_items: Any, chunk: int) -> None:
        self.hn, self.labels, self.num_items = hn, labels, num_items
        self.step = max(1, chunk // max(1, hn.shape[0]))
        shape = hn.shape[:2]
        self.top = torch.full(shape, -torch.inf, dtype=torch.float32, device=hn.device)
        """Running maximum logit per token (fp32)."""
        self.sum = torch.zeros(shape, dtype=torch.float32, device=hn.device)
        """Running Σ exp(logit − ``top``) per token."""
        self.target = torch.zeros(shape, dtype=torch.float32, device=hn.device)
        """The label's logit per token (0 for an ignored token)."""
        self.lse: torch.Tensor | None = None

    def _slices(self) -> list[slice]:
        t = self.hn.shape[1]
        return [slice(s, min(s + self.step, t)) for s in range(0, t, self.step)]

    def _local(self, labels: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inside, local): which labels fall in rows [lo, hi), and their row index there (0 if not)."""
        inside = (labels >= lo) & (labels < hi)
        return inside, torch.where(inside, labels - lo, 0)

    def forward_group(self, logits: Logits, lo: int, hi: int) -> None:
        """Fold the logits of rows [lo, hi) into the running log-sum-exp and the labels' logits."""
        for sl in self._slices():
            with torch.no_grad():
                z = logits(self.hn[:, sl]).float()
                top = torch.maximum(self.top[:, sl], z.amax(-1))
                self.sum[:, sl] = self.sum[:, sl] * torch.exp(self.top[:, sl] - top) + torch.exp(
                    z - top.unsqueeze(-1)
                ).sum(-1)
                self.top[:, sl] = top
                inside, local = self._local(self.labels[:, sl], lo, hi)
                picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)
                self.target[:, sl] += torch.where(inside, picked, 0.0)

    def loss(self) -> torch.Tensor:
        """The micro-batch's loss (fp32 scalar): Σ over labelled tokens of lse − label logit, ÷ items.
        Call after every group's ``forward_group``."""
        self.lse = self.top + torch.log(self.sum)
        valid = self.labels != IGNORE
        return torch.where(valid, self.lse - self.target, 0.0).sum() / self.num_items

    def backward_group(self, logits: Logits, lo: int, hi: int, dhn: torch.Tensor) -> None:
        """Backward of rows [lo, hi): their logits recomputed with autograd (weight gradients land where
        the head group's parameters point), seeded with ``(softmax − onehot) ÷ items`` on labelled
        tokens; the normed states' gradient is added into ``dhn`` (fp32, ``[b, t, hidden]``). Call
        after ``loss``."""
        assert self.lse is not None, "loss() before backward_group()"
        for sl in self._slices():
            piece = self.hn[:, sl].detach().requires_grad_()
            with torch.enable_grad():
                z = logits(piece)
            with torch.no_grad():  # in place where it can: the logits' fp32 copy is the chunk's largest tensor
                g = (z.float() - self.lse[:, sl].unsqueeze(-1)).exp_()
                inside, local = self._local(self.labels[:, sl], lo, hi)
                g.scatter_add_(-1, local.unsqueeze(-1), -inside.unsqueeze(-1).to(g.dtype))
                weight = (self.labels[:, sl] != IGNORE).to(g.dtype) / self.num_items
                g *= weight.unsqueeze(-1)
            z.backward(g.to(z.dtype))
            assert piece.grad is not None
            dhn[:, sl] += piece.grad


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """Each token's label: the next token's (``[b, t]``; the last ``IGNORE``), as ``ForCausalLMLoss``."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[:, 1:]
