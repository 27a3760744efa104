"""What an earlier run left behind, and the rule that starting a run never deletes it by accident.

A fresh start (no ``--resume``) refuses when ``--output`` or the ``--ssd`` directories hold an
earlier run — a finished model (``run.json``, ``model/``), a store, or checkpoints — unless
``--overwrite``. ``--resume auto`` that finds no intact checkpoint starts fresh, but refuses to
replace a finished model without ``--overwrite``; damaged checkpoints are set aside, not deleted.
"""

from __future__ import annotations

import os
import shutil

from fuyou.checkpoint.snapshot import CKPT
from fuyou.errors import ConfigError
from fuyou.storage.manifest import MANIFEST
from fuyou.storage.store import ID_FILE

FINISHED = ("run.json", "model")
"""What a finished run writes into its output directory (run.json last)."""
FIX = "pass --resume auto to continue, or --overwrite to start over"


def finished_outputs(output: str) -> list[str]:
    """The paths among ``output``/run.json and ``output``/model/ that exist."""
    found = [os.path.join(output, f) for f in FINISHED if os.path.lexists(os.path.join(output, f))]
    return [p + "/" if os.path.isdir(p) else p for p in found]


def _checkpoint_entries(stripe: str) -> list[str]:
    root = os.path.join(stripe, CKPT)
    try:
        return sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):  # no store there (yet): --ssd itself is checked later
        return []


def earlier_run(output: str, stripes: list[str]) -> list[str]:
    """What an earlier run left in ``output`` and the store directories ``stripes``, one phrase each.

    Empty when there is nothing: no run.json/model/, no store (ID file or manifest), no checkpoints.
    """
    found = []
    done = finished_outputs(output)
    if done:
        found.append(f"a finished run ({' and '.join(done)})")
    for d in stripes:
        if any(os.path.exists(os.path.join(d, f)) for f in (ID_FILE, MANIFEST)):
            found.append(f"a store in {d}")
        entries = _checkpoint_entries(d)
        if entries:
            shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
            found.append(
                f"{len(entries)} checkpoint entr{'y' if len(entries) == 1 else 'ies'} in "
                f"{os.path.join(d, CKPT)} ({shown})"
            )
    return found


def check_fresh_start(output: str, stripes: list[str], overwrite: bool) -> None:
    """A fresh start (no ``--resume``) may begin: nothing of an earlier run exists, or ``overwrite``.

    Raises ConfigError (one line) naming what exists and the fix; deletes nothing.
    """
    found = [] if overwrite else earlier_run(output, stripes)
    if found:
        raise ConfigError(f"refusing to start a fresh run over an earlier one: {'; '.join(found)}; {FIX}")


def check_fresh_after_auto(output: str, overwrite: bool) -> None:
    """``--resume auto`` found no intact checkpoint: starting fresh may not replace a finished model
    unless ``overwrite``. Raises ConfigError naming it."""
    done = [] if overwrite else finished_outputs(output)
    if done:
        raise ConfigError(
            f"--resume auto found no intact checkpoint to continue from, and {output} holds a "
            f"finished run ({' and '.join(done)}); pass --overwrite to start over"
        )


def clear_finished(output: str) -> None:
    """Delete ``run.json`` and ``model/`` (a starting or continuing run writes new ones at its end)."""
    for name in FINISHED:
        p = os.path.join(output, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)
