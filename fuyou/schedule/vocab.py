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

A tied head borrows the whole embedding matrix for its logits, so a tied model is not split (the
adapter refuses it by name). The head of an untied model is not split yet (it is as large as the embedding)."""

from __future__ import annotations

from fuyou.schedule.experts import VOCAB_PART, group_ranges

__all__ = ["EMBED", "VOCAB_PART", "row_ranges", "vocab_block_name"]
EMBED = "embed"
"""The first vocabulary group keeps the embedding block's own name (it makes the micro-batch context)."""


def vocab_block_name(g: int) -> str:
    """The block name of vocabulary group ``g``: ``embed`` for the first, ``embed.vocab.<g>`` after."""
    return EMBED if g == 0 else f"{EMBED}{VOCAB_PART}{g}"


def row_ranges(vocab: int, groups: int) -> list[tuple[int, int]]:
    """Rows [lo, hi) of each of ``groups`` contiguous, near-equal vocabulary groups."""
    return group_ranges(vocab, groups)
