"""How a mixture-of-experts layer's experts are cut into groups that stream as blocks of their own
(``Plan.expert_groups``): the group counts tried, and each group's experts. Plain Python: the
model description (``fuyou.models.blocks.split_experts``), the engine's choice and the planner's
shapes all follow it."""

from __future__ import annotations

from collections.abc import Iterator

VOCAB_PART = ".vocab."
"""Infix of a later vocabulary group's block name (``fuyou.schedule.vocab``, which re-exports it)."""
EXPERTS_PART = ".experts."
"""Infix of an expert-group block's name: ``layer.3.experts.1`` is group 1 of decoder layer 3."""


def group_ranges(experts: int, groups: int) -> list[tuple[int, int]]:
    """Experts [lo, hi) of each of ``groups`` contiguous, near-equal groups (sizes differ by ≤ 1)."""
    return [(g * experts // groups, (g + 1) * experts // groups) for g in range(groups)]


def expert_group_options(experts: int) -> list[int]:
    """The group counts tried, smallest first, when a layer's experts must be split: 1, the powers of
    two below ``experts``, then one group per expert."""
    out, g = [1], 2
    while g < experts:
        out.append(g)
        g *= 2
    return out + ([experts] if experts > 1 else [])


def spread_policies(policies: tuple[str, ...], names: list[str]) -> tuple[str, ...]:
    """Per-block activation policies given for the blocks of the unsplit model (``policies``: one per
    block, the expert groups and later vocabulary groups left out), spread over the blocks ``names``:
    each expert group takes its layer's, each vocabulary group the embedding's. Policies given for
    ``names`` already, or none, come back unchanged."""
    if len(policies) != sum(not _part(n) for n in names) or len(policies) == len(names):
        return policies  # none, already per block, or a count ``Plan.policy`` refuses by name
    given = iter(policies)
    return tuple(_spread(given, names))


def _spread(given: Iterator[str], names: list[str]) -> Iterator[str]:
    last = ""
    for name in names:
        last = last if _part(name) else next(given)
        yield last


def _part(name: str) -> bool:
    """Whether block ``name`` is a part split off a block before it (an expert group, a later
    vocabulary group: ``fuyou.schedule.vocab``)."""
    return EXPERTS_PART in name or VOCAB_PART in name
