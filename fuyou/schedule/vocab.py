"""How an embedding is cut by vocabulary rows into blocks that stream one after the other
(``Plan.vocab_groups``), so that a large vocabulary (Llama-3's 128 k, Gemma's 262 k) does not make the
embedding the block that sizes every host weight buffer (``sizing.buffer_classes``). Plain Python:
the model description (``fuyou.models.blocks.split_vocab``), the engine's adapter and the planner's
shapes all follow it.

How a split embedding computes, exactly: group ``g`` owns rows [lo, hi) of the embedding matrix. The
first group (block ``embed``) looks up the tokens whose ids fall in its rows and writes zeros for the
others; each later group (``embed.vocab.<g>``) adds its rows' embeddings for its tokens to the stream:
``x + where(lo ≤ ids < hi, E_g[ids − lo], 0)``. Every token is found in exactly one group and every
other group adds an exact zero, so the sum is the unsplit lookup bit for bit; each group's gradient is
the unsplit gradient's rows [lo, hi) (a sparse scatter of the tokens it owns). The later groups are
additive blocks (``fuyou.engine.activations``): their backward needs no input and passes ``dy`` on.

The untied LM head is cut by the same rows: group ``g`` (block ``head`` for the first, which also
holds the final norm; ``head.vocab.<g>`` after) makes the logits of its rows only. The loss needs every
row's logit (a softmax over the whole vocabulary), so the turnaround takes two passes over the groups
(``fuyou.engine.vocab_loss``): forward, group by group, keeps per token a running maximum and sum of
exponentials and the label's logit (the log-sum-exp, exact up to rounding; no logits kept); backward,
the groups in reverse (the last still resident, the others read again), recomputes each group's
logits, takes its softmax rows minus the one-hot label (``exp(z − lse) − [label]``) as their gradient,
and accumulates the normed hidden states' gradient in fp32; the final norm's backward comes last, with
the first group. What it costs: one more forward matmul of the head, and reading every head group but
the last twice.

A tied head borrows the whole embedding matrix for its logits, so a tied model is not split (the
adapter refuses it by name)."""

from __future__ import annotations

from fuyou.schedule.experts import VOCAB_PART, group_ranges

__all__ = ["EMBED", "HEAD", "VOCAB_PART", "bounding_groups", "head_block_name", "row_ranges", "vocab_block_name"]
EMBED = "embed"
"""The first vocabulary group keeps the embedding block's own name (it makes the micro-batch context)."""


HEAD = "head"
"""The first head group keeps the head block's name (it holds the final norm)."""


def head_block_name(g: int) -> str:
    """The block name of head group ``g``: ``head`` for the first, ``head.vocab.<g>`` after."""
    return HEAD if g == 0 else f"{HEAD}{VOCAB_PART}{g}"


def vocab_block_name(g: int) -> str:
    """The block name of vocabulary group ``g``: ``embed`` for the first, ``embed.vocab.<g>`` after."""
    return EMBED if g == 0 else f"{EMBED}{VOCAB_PART}{g}"


def bounding_groups(vocab: int, hidden: int, layer_numel: int) -> int:
    """The fewest vocabulary groups whose every block (``hidden`` elements a row, the first head group a
    norm more) is no larger than a decoder layer of ``layer_numel`` elements: how far a split goes when
    the embedding and head set the host floor (``sizing.buffer_classes`` sizes every weight buffer by
    the largest block). 1 when they are no larger already."""
    rows = max(1, (layer_numel - hidden) // hidden)
    return max(1, min(vocab, -(-vocab // rows)))


def row_ranges(vocab: int, groups: int) -> list[tuple[int, int]]:
    """Rows [lo, hi) of each of ``groups`` contiguous, near-equal vocabulary groups."""
    return group_ranges(vocab, groups)
