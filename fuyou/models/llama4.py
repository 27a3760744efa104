"""Llama 4's mixture of experts, routed: the one place its ``transformers`` modules depart from what the
generic adapter needs.

``transformers``' ``Llama4TextMoe`` runs every expert on every token, the tokens an expert was not chosen
for scaled to zero (``Llama4TextExperts.forward`` over ``num_experts`` copies of the batch): 128 experts'
FLOPs per token for Maverick, where 1 is routed, and no way to cut a layer into expert groups. Here each
expert runs on the tokens routed to it only, with Llama 4's own rule: the expert's *input* is scaled by
the router's sigmoid weight (``w · x``, not ``w · expert(x)`` as in the other families). An expert of
zero input gives zero output (no biases), so the result is the dense one's up to the order of fp32
sums. The experts module takes ``(hidden, top_k_index, top_k_weights)`` as every other family's does,
so a layer splits into expert groups (``fuyou.models.adapters.LlamaLike._split_experts``); its
parameters keep their names and layouts (``gate_up_proj`` [E, h, 2I], ``down_proj`` [E, I, h]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RoutedExperts(nn.Module):
    """Llama 4's experts, each run on the tokens routed to it (its parameters: ``Llama4TextExperts``')."""

    def __init__(self, config: Any) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.num_experts = config.num_local_experts
        self.hidden_size, inner = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(self.num_experts, self.hidden_size, 2 * inner))
        self.down_proj = nn.Parameter(torch.zeros(self.num_experts, inner, self.hidden_size))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Σ over each token's chosen experts e of expert_e(w · x) (``hidden`` [tokens, h]; ``top_k_index``,
        ``top_k_weights`` [tokens, k]); an index of ``num_experts`` or more (another expert group's) is skipped."""
        out = torch.zeros_like(hidden)
        hit = torch.unique(top_k_index[top_k_index < self.num_experts])  # the experts any token chose
        for e in hit.tolist():
            rows, slot = torch.where(top_k_index == e)
            x = hidden[rows] * top_k_weights[rows, slot, None].to(hidden.dtype)
            gate, up = (x @ self.gate_up_proj[e]).chunk(2, dim=-1)
            out.index_add_(0, rows, (up * self.act_fn(gate)) @ self.down_proj[e])
        return out


def route(moe: nn.Module, config: Any) -> None:
    """Make a ``Llama4TextMoe`` (on the meta device) run its experts routed: its experts module a
    ``RoutedExperts`` of the same parameters, its ``forward`` ``_routed_forward``."""
    moe.experts = RoutedExperts(config)
    moe.forward = _routed_forward.__get__(moe)


def _routed_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Llama4TextMoe.forward``'s result (the shared expert plus the routed experts; the router's logits),
    the routed part from the tokens' own experts only."""
    hidden = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(hidden)  # scores: the top-k logits' sigmoid, 0 elsewhere
    weights, index = torch.topk(scores, self.top_k, dim=-1)
    return self.shared_expert(hidden) + self.experts(hidden, index, weights), logits


def route_experts(model: nn.Module, config: Any) -> None:
    """Route every Llama 4 mixture-of-experts layer of ``model`` (``route``); other models unchanged."""
    for mod in model.modules():
        if type(mod).__name__ == "Llama4TextMoe":
            route(mod, config)
