"""LongCat-Flash's experts in an expert group: the one place its ``transformers`` modules depart from what
splitting a layer into expert groups needs (``fuyou.models.adapters.LlamaLike._split_experts``).

``transformers``' ``LongcatFlashExperts`` loops over the experts any token chose, its ``zero_expert_num``
zero-computation experts (indices from ``n_routed_experts`` on) returning their input times the routing
weight. An expert group must skip the tokens routed to other groups' experts (mapped to index
``num_experts``, as ``transformers``' expert kernels skip them for expert parallelism); that loop cannot:
it counts such an index as a zero-computation expert. ``GroupExperts`` runs its experts as that loop runs
a routed expert (``gate_up_proj`` row → ``act(gate) · up`` → ``down_proj`` row, times the weight, added
into the output expert by expert in index order) and skips every other index. Its parameters keep the
family's names and layouts (``gate_up_proj`` [E + Z, 2I, h], of which the last Z rows no expert reads;
``down_proj`` [E, h, I]). The zero-computation experts are added by the layer's core
(``adapters.RouteCapture``'s ``identity_from``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class GroupExperts(nn.Module):
    """A group of LongCat-Flash's routed experts (``n_routed_experts`` of them, tensors sized for
    ``zero_expert_num`` more), skipping any other index."""

    def __init__(self, config: Any) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.num_experts = config.n_routed_experts
        rows = self.num_experts + (config.zero_expert_num or 0)
        inner, hidden = config.expert_ffn_hidden_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(rows, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.zeros(self.num_experts, hidden, inner))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Σ over each token's chosen experts e of w · expert_e(x) (``hidden`` [tokens, h]; ``top_k_index``,
        ``top_k_weights`` [tokens, k]); an index of ``num_experts`` or more is skipped."""
        out = torch.zeros_like(hidden)
        for e in torch.unique(top_k_index[top_k_index < self.num_experts]).tolist():
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(hidden.dtype))
        return out


GROUP_EXPERTS: dict[str, type[nn.Module]] = {"LongcatFlashExperts": GroupExperts}
"""A family's experts class (by name) → the module its expert groups run instead, where the family's own
cannot skip the tokens routed to other groups."""
