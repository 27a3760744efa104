"""The mixture-of-experts balance loss, over one micro-batch or over the whole step.

It is the Switch Transformer loss that ``transformers`` computes (``load_balancing_loss_func``):

    aux = E · Σ_e f_e · P_e

Here f_e is the share of the top-k choices that picked expert e, over every (router layer, token)
row, and P_e is expert e's mean router probability over those rows. The loss adds ``coef · aux``,
where ``coef`` is the config's ``router_aux_loss_coef``.

f is a count with no gradient. So aux is linear in each layer's probability sums S_l = Σ_t p_{l,t},
and its gradient is ∂aux/∂S_l,e = E · C_e / N² (C_e choices of e among N rows). Each layer's
backward seeds its S_l with ``coef`` times that. C and N are known only once every layer has run
forward. Layer-grouped accumulation gets there before any backward, so the counts of the whole step
cost nothing extra.

* ``micro``: C, S and N per micro-batch. This is the HF model's own loss for that micro-batch. The
  step's loss adds the mean over the step's micro-batches, every rank's included.
* ``global``: C, S and N over every micro-batch of the step and every rank (Qiu et al., "Demons in
  the detail"). This costs one all-reduce of 2E + 1 numbers at the turnaround.

None of the supported families defines a router z-loss. DeepSeek-V3 and GLM-4.5 define no balance loss
at all (``defines_balance_loss``): they balance by a bias on the router's choice
(``e_score_correction_bias``), which a checkpoint carries and Fuyou keeps as the family uses it, untrained
and in fp32 where ``transformers`` keeps it so (``fuyou.engine.family_buffers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fuyou.errors import ConfigError
from fuyou.models.activation_rules import experts_of, top_k_of
from fuyou.transfer.collectives import Collectives

MODES = ("global", "micro", "off")
"""``--moe-balance`` values: frequencies over the step (default), per micro-batch, or no balance loss."""


@dataclass(frozen=True)
class BalanceRule:
    """How a mixture of experts' balance loss is computed."""

    mode: str
    """``global`` or ``micro``."""
    coef: float
    """Weight of the loss (the config's ``router_aux_loss_coef``)."""
    experts: int
    top_k: int


def balance_rule(config: Any, mode: str) -> BalanceRule | None:
    """The balance loss of ``config``'s model under ``--moe-balance mode``.

    Returns None when there is none: ``off``, a dense model, or a zero coefficient. Raises
    ConfigError for an unknown mode.
    """
    if mode not in MODES:
        raise ConfigError(f"--moe-balance must be one of {', '.join(MODES)}, got {mode!r}")
    experts, top_k = experts_of(config), top_k_of(config)
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if mode == "off" or not experts or not top_k or coef == 0.0 or not defines_balance_loss(config):
        return None
    return BalanceRule(mode, coef, int(experts), int(top_k))


def defines_balance_loss(config: Any) -> bool:
    """Whether ``config``'s family computes the Switch balance loss in ``transformers`` (its modeling
    module has ``load_balancing_loss_func``); not DeepSeek-V3 or GLM-4.5, whose routers balance by a bias."""
    import sys

    from fuyou.models.families import causal_lm_class

    cls = causal_lm_class(getattr(config, "model_type", "") or "")
    return cls is None or hasattr(sys.modules[cls.__module__], "load_balancing_loss_func")


def prob_sums(logits: list[torch.Tensor]) -> torch.Tensor:
    """Σ over rows of the router probabilities, summed over a block's router calls. The logits are
    ``[rows, experts]``; the result is ``[experts]`` fp32 and differentiable."""
    return sum(torch.softmax(lg.float(), dim=-1).sum(0) for lg in logits)  # type: ignore[return-value]


class StepBalance:
    """One step's router statistics (on the device) and the gradient seeds of its balance loss."""

    def __init__(self, rule: BalanceRule, micro_batches: int, device: torch.device, comm: Collectives) -> None:
        self.rule, self.comm = rule, comm
        self.world = comm.world
        shape = (micro_batches, rule.experts)
        self.counts = torch.zeros(shape, dtype=torch.float64, device=device)
        """C: top-k choices per (micro-batch, expert)."""
        self.probs = torch.zeros(shape, dtype=torch.float64, device=device)
        """S: summed router probabilities per (micro-batch, expert)."""
        self.rows = [0] * micro_batches
        """N: router rows (layers × tokens) per micro-batch, known from shapes alone."""
        self.seeds: torch.Tensor | None = None

    def observe(self, k: int, logits: list[torch.Tensor]) -> torch.Tensor | None:
        """Forward of a block for micro-batch ``k``: count its routers' choices and probabilities.

        ``logits`` are the block's router logits in call order. Returns S for the block, which is
        differentiable when they are, or None when the block has no router.
        """
        if not logits:
            return None
        s = prob_sums(logits)
        with torch.no_grad():
            for lg in logits:
                chosen = torch.topk(lg.detach().float(), self.rule.top_k, dim=-1).indices.flatten()
                self.counts[k].index_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float64))
                self.rows[k] += lg.shape[0]
            self.probs[k] += s.detach()
        return s

    def turnaround(self) -> tuple[torch.Tensor, torch.Tensor]:
        """After every block's forward: fix the seeds and return this rank's share of the loss.

        Returns (coef · aux, aux), both 0-d fp64 on the device. Summed over ranks, they give the
        step's balance loss term and the loss itself, as ``transformers`` reports ``aux_loss``.
        """
        r, E = self.rule, self.rule.experts
        dev = self.counts.device
        if r.mode == "global":
            rows = torch.tensor([float(sum(self.rows))], dtype=torch.float64, device=dev)
            tot = torch.cat([self.counts.sum(0), self.probs.sum(0), rows])
            self.comm.sum_on_device(tot, "balance counts")
            c, s, n_all = tot[:E], tot[E : 2 * E], tot[2 * E]
            aux = E * (c * s).sum() / n_all**2
            seeds = (r.coef * E * c / n_all**2).expand(len(self.rows), E)
            share = aux / self.world
        else:
            n = torch.tensor(self.rows, dtype=torch.float64, device=dev)
            per_micro = E * (self.counts * self.probs).sum(1) / n**2
            total = len(self.rows) * self.world
            seeds = r.coef * E * self.counts / (n.unsqueeze(1) ** 2 * total)
            share = per_micro.sum() / total
        self.seeds = seeds.float().contiguous()
        return r.coef * share, share

    def seed(self, k: int) -> torch.Tensor:
        """∂(coef · aux)/∂S for micro-batch ``k``'s blocks (after ``turnaround``)."""
        assert self.seeds is not None  # the turnaround comes before any backward
        return self.seeds[k]
