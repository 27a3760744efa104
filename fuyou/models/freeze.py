"""The ``--freeze`` rule, written once: which parameters (by Hugging Face key) and which blocks a run's
glob patterns freeze. The engine's assembly (``fuyou.engine.assembly``), export and the model
description the planner plans with (``fuyou.models.description``) all ask it."""

from __future__ import annotations

import fnmatch

from fuyou.errors import ConfigError
from fuyou.models.blocks import BlockSpec, parse_slice


def frozen_keys(
    blocks: tuple[BlockSpec, ...], patterns: tuple[str, ...], never: tuple[str, ...] = ()
) -> frozenset[str]:
    """The store keys of the parameters that never train: those ``patterns`` (``fnmatch`` globs on
    Hugging Face keys; an expert group's slice matches as its fused tensor) freeze (``--freeze``), and
    those ``never`` names: the parameters the family's own code computes without gradient
    (``families.untrained``), which plain PyTorch's AdamW never updates (they get no gradient, so not even
    weight decay) and Fuyou freezes alike. The family's persistent buffers are not parameters
    (``BlockSpec.buffers``): they never train. Raises ConfigError naming a pattern that matches nothing,
    or when nothing would be left to train."""
    keys = [p.key for blk in blocks for p in blk.params]
    names = {k: (parse_slice(k) or (k,))[0] for k in keys}
    out = frozenset(k for k in keys if any(fnmatch.fnmatchcase(names[k], pat) for pat in (*patterns, *never)))
    unused = [pat for pat in patterns if not any(fnmatch.fnmatchcase(n, pat) for n in names.values())]
    if unused:
        raise ConfigError(
            f"--freeze {unused[0]!r} matches no parameter of this model (names look like {keys[-2]!r}); fix the pattern"
        )
    if patterns and len(out) == len(keys):
        raise ConfigError("--freeze matches every parameter: nothing would train; freeze fewer, or use --lora-rank")
    return out


def frozen_blocks(
    blocks: tuple[BlockSpec, ...], patterns: tuple[str, ...], never: tuple[str, ...] = ()
) -> frozenset[int]:
    """The blocks whose every parameter ``patterns`` (and ``never``: ``frozen_keys``) freeze: no optimizer
    state, never written."""
    keys = frozen_keys(blocks, patterns, never)
    return frozenset(b for b, blk in enumerate(blocks) if all(p.key in keys for p in blk.params))
