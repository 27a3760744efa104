"""How the optimizer state is stored (``--optimizer-state``), and what it costs in bytes: written once, read by
the store layout, the Adam stage and the planner alike.

* ``fp32`` — an fp32 master, fp32 m and v per element (12 B), beside the compute weights.
* ``split`` — the master kept exactly as the compute weights plus a remainder of the bits they drop
  (``fuyou.optim.split``: 2 B beside bf16 weights, none beside fp32 ones), fp32 m and v. Bit-identical to
  ``fp32``; the Adam stage reads the block's compute weights to rebuild the master.
* ``bf16`` — ``split`` with bf16 m and v (rounded to nearest even after each update: lossy).

``auto`` (the default of ``fuyou finetune``, ``EngineConfig`` and ``FuyouTrainer``) is the format of the
store being resumed, else ``DEFAULT_FORMAT``: ``split``, exact at 12 of ``fp32``'s 14 B per parameter
beside bf16 weights, measured no slower (``bench/RESULTS.md``, session 20: 0.87 × fp32's step where the
SSD binds on the lent H100 machine; 1.01 × where the CPU binds on 2 cores).

A store written by an older Fuyou with fp32 masters and bf16 moments (``state_precision="bf16"``) resumes as
``fp32-bf16``, which new runs are not offered.

Bytes per element of a block's flat vector, its compute weights of ``compute`` bytes each:
``state_bytes`` in the store beside the weights; ``adam_read``/``adam_written`` what one update moves
(state, plus the compute weights a split master reads and every format writes).
"""

from __future__ import annotations

from dataclasses import dataclass

from fuyou.errors import ConfigError


@dataclass(frozen=True)
class StateFormat:
    """One way of storing a block's AdamW state."""

    name: str
    """The ``--optimizer-state`` name."""
    split: bool
    """The master is the compute weights plus a remainder (else an fp32 vector of its own)."""
    moment_bytes: int
    """Bytes of each of m and v per element: 4 (fp32) or 2 (bf16)."""
    lossless: bool
    """Every update equals the fp32-state update bit for bit."""

    def remainder_bytes(self, compute: int) -> int:
        """Bytes per element of the master stored beside ``compute``-byte weights."""
        return 4 - compute if self.split else 4

    def state_bytes(self, compute: int) -> int:
        """Bytes per element of a state chunk (master or remainder, m, v)."""
        return self.remainder_bytes(compute) + 2 * self.moment_bytes

    def adam_read(self, compute: int) -> int:
        """Bytes per element one update reads: its state, and for a split master the compute weights."""
        return self.state_bytes(compute) + (compute if self.split else 0)

    def adam_written(self, compute: int) -> int:
        """Bytes per element one update writes: its state and the new compute weights."""
        return self.state_bytes(compute) + compute


FORMATS: dict[str, StateFormat] = {
    f.name: f
    for f in (
        StateFormat("fp32", split=False, moment_bytes=4, lossless=True),
        StateFormat("split", split=True, moment_bytes=4, lossless=True),
        StateFormat("bf16", split=True, moment_bytes=2, lossless=False),
        StateFormat("fp32-bf16", split=False, moment_bytes=2, lossless=False),
    )
}
OFFERED: tuple[str, ...] = ("fp32", "split", "bf16")
"""The formats a new run may choose (``fp32-bf16`` only resumes)."""
AUTO = "auto"
"""The store's format when resuming, else ``DEFAULT_FORMAT`` (``resolve_format``)."""
DEFAULT_FORMAT = "split"
"""A new store's format when ``auto``: lossless, 2 B per parameter fewer than ``fp32`` beside bf16 weights."""
CHOICES: tuple[str, ...] = (AUTO, *OFFERED)
"""What ``--optimizer-state`` accepts."""


def resolve_format(name: str, stored: str | None = None) -> str:
    """The format a run uses: ``name``, or for ``auto`` the format of the store it resumes (``stored``, None
    for a new store) else ``DEFAULT_FORMAT``. Raises ConfigError for a name that is neither."""
    if name == AUTO:
        return stored or DEFAULT_FORMAT
    state_format(name, resumable=True)
    return name


def state_format(name: str, resumable: bool = False) -> StateFormat:
    """The format called ``name``; ``resumable``: also one only an existing store may have.

    Raises ConfigError naming the choices for another name."""
    if name in OFFERED or (resumable and name in FORMATS):
        return FORMATS[name]
    raise ConfigError(f"--optimizer-state must be one of {', '.join(OFFERED)}, got {name!r}")
