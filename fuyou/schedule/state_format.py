"""How the optimizer state is stored (``--optimizer-state``), and what it costs in bytes: written once, read by
the store layout, the Adam stage and the planner alike.

* ``fp32`` — an fp32 master, fp32 m and v per element (12 B), beside the compute weights.
* ``split`` — the master kept exactly as the compute weights plus a remainder of the bits they drop
  (``fuyou.optim.split``: 2 B beside bf16 weights, none beside fp32 ones), fp32 m and v. Bit-identical to
  ``fp32``; the Adam stage reads the block's compute weights to rebuild the master.
* ``bf16`` — ``split`` with bf16 m and v (rounded to nearest even after each update: lossy).
* ``int8`` — ``split`` with 8-bit m and v, block-wise quantized (``fuyou.optim.quant8``: ``QUANT_BLOCK``
  elements per fp32 scale, dynamic tree maps; lossy): 4.03 B per element beside bf16 weights. The tie flag
  of an element whose remainder is a tie is the parity of its v code.

``auto`` (the default of ``fuyou finetune``, ``EngineConfig`` and ``FuyouTrainer``) is the format of the
store being resumed, else ``DEFAULT_FORMAT``: ``split``, exact at 12 of ``fp32``'s 14 B per parameter
beside bf16 weights, measured no slower (``bench/RESULTS.md``, session 20: 0.87 × fp32's step where the
SSD binds on the lent H100 machine; 1.01 × where the CPU binds on 2 cores).

A store written by an older Fuyou with fp32 masters and bf16 moments (``state_precision="bf16"``) resumes as
``fp32-bf16``, which new runs are not offered.

Bytes of a block's state, its compute weights of ``compute`` bytes each: ``chunk_bytes`` of one chunk exactly
as the store lays it out (``parts``: its tensors, each at ``TENSOR_ALIGN``); ``state_bytes`` per element
(block scales spread over their elements, alignment not counted); ``adam_read``/``adam_written`` what one
update moves per element (state, plus the compute weights a split master reads and every format writes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fuyou.errors import ConfigError
from fuyou.units import TENSOR_ALIGN, align_up

QUANT_BLOCK = 256
"""Elements per quantization block of 8-bit moments: one fp32 scale per block and moment
(``fuyou.optim.quant8.BLOCK``)."""


@dataclass(frozen=True)
class StateFormat:
    """One way of storing a block's AdamW state."""

    name: str
    """The ``--optimizer-state`` name."""
    split: bool
    """The master is the compute weights plus a remainder (else an fp32 vector of its own)."""
    moment_bytes: int
    """Bytes of each of m and v per element: 4 (fp32), 2 (bf16) or 1 (8-bit codes)."""
    lossless: bool
    """Every update equals the fp32-state update bit for bit."""
    quant_block: int = 0
    """8-bit moments: elements per block sharing one fp32 scale per moment (0: no scales)."""

    def remainder_bytes(self, compute: int) -> int:
        """Bytes per element of the master stored beside ``compute``-byte weights."""
        return 4 - compute if self.split else 4

    def parts(self, n: int, compute: int) -> tuple[tuple[str, int, str], ...]:
        """The tensors of an ``n``-element state chunk in store order: (name, elements, dtype name) — the
        master (``master``, fp32) or a split master's remainder (``rem``, int16; none beside fp32 weights),
        m and v, and for 8-bit moments their block scales (``m_scale``, ``v_scale``: fp32, one per
        ``quant_block`` elements, the last block partial)."""
        master = (
            ()
            if self.remainder_bytes(compute) == 0
            else (("rem", n, "int16") if self.split else ("master", n, "float32"),)
        )
        mdt, vdt = {4: ("float32", "float32"), 2: ("bfloat16", "bfloat16"), 1: ("int8", "uint8")}[self.moment_bytes]
        out = (*master, ("m", n, mdt), ("v", n, vdt))
        if self.quant_block:
            nb = -(-n // self.quant_block)
            out += (("m_scale", nb, "float32"), ("v_scale", nb, "float32"))
        return out

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - formats are a handful of frozen values; the planner asks millions of times
    def chunk_bytes(self, n: int, compute: int) -> int:
        """Bytes of an ``n``-element state chunk as the store lays it out: ``parts``, each at ``TENSOR_ALIGN``."""
        size = {"float32": 4, "bfloat16": 2, "int16": 2, "int8": 1, "uint8": 1}
        pos = 0
        for i, (_, k, dt) in enumerate(self.parts(n, compute)):
            pos = (align_up(pos, TENSOR_ALIGN) if i else 0) + k * size[dt]
        return pos

    def block_bytes(self, numel: int, chunk: int, compute: int) -> int:
        """Bytes of a block's ``numel``-element state stored in chunks of ``chunk`` elements (the last one
        shorter: ``sizing.state_chunks``): the sum of their ``chunk_bytes``."""
        full, rest = divmod(numel, chunk)
        return full * self.chunk_bytes(chunk, compute) + (self.chunk_bytes(rest, compute) if rest else 0)

    def state_bytes(self, compute: int) -> float:
        """Bytes per element of a state chunk (master or remainder, m, v, and 8-bit moments' scales spread
        over their blocks; ``chunk_bytes`` for a chunk's exact size)."""
        scales = 2 * 4 / self.quant_block if self.quant_block else 0.0
        return self.remainder_bytes(compute) + 2 * self.moment_bytes + scales

    def adam_read(self, compute: int) -> float:
        """Bytes per element one update reads: its state, and for a split master the compute weights."""
        return self.state_bytes(compute) + (compute if self.split else 0)

    def adam_written(self, compute: int) -> float:
        """Bytes per element one update writes: its state and the new compute weights."""
        return self.state_bytes(compute) + compute


FORMATS: dict[str, StateFormat] = {
    f.name: f
    for f in (
        StateFormat("fp32", split=False, moment_bytes=4, lossless=True),
        StateFormat("split", split=True, moment_bytes=4, lossless=True),
        StateFormat("bf16", split=True, moment_bytes=2, lossless=False),
        StateFormat("int8", split=True, moment_bytes=1, lossless=False, quant_block=QUANT_BLOCK),
        StateFormat("fp32-bf16", split=False, moment_bytes=2, lossless=False),
    )
}
OFFERED: tuple[str, ...] = ("fp32", "split", "bf16", "int8")
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
