"""Model FLOPs per token, with the formula stated (what achieved TFLOPS and MFU are computed from).

Training FLOPs per token = 6 · N_matmul + 12 · L · d · T, where N_matmul counts every weight used in
a matrix multiply (all linear layers and the LM head; embedding lookups and norms excluded), L is
the number of layers, d the model width and T the sequence length. The second term is attention's
QKᵀ and AV products: 2 · 2 · L · d · T per token forward, × 3 for forward + backward, without causal
halving (PaLM's MFU accounting). Recomputation is not counted: these are model FLOPs, not hardware
FLOPs.
"""

from __future__ import annotations

from typing import Any

FORMULA = "6*N_matmul + 12*L*d*T (N_matmul: linear + LM-head weights; no recompute; PaLM-style)"


def matmul_params(blocks: list[Any]) -> int:
    """Weights used in matmuls: every 2-D parameter except embedding tables, plus a tied LM head."""
    n = 0
    for blk in blocks:
        for p in blk.params:
            if len(p.shape) == 2 and not any(s in p.key for s in ("embed_tokens", "wte", "wpe")):
                n += p.numel
        if blk.borrows:  # tied LM head uses the embedding matrix as a matmul weight
            n += blk.flops_per_token // 2 - sum(p.numel for p in blk.params if len(p.shape) == 2)
    return n


def train_flops_per_token(blocks: list[Any], layers: int, width: int, seq_len: int) -> int:
    """Model FLOPs of forward + backward per token (see the module docstring)."""
    return 6 * matmul_params(blocks) + 12 * layers * width * seq_len
