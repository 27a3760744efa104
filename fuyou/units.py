"""Byte sizes as users write them (``512MiB``, ``64GiB``, ``1.5GB``) and as Fuyou prints them."""

from __future__ import annotations

import math
import re

from fuyou.errors import ConfigError

HOST_ALIGN = 4096
"""Alignment of host buffers (a page; O_DIRECT's): the pool counts every buffer rounded up to it."""
TENSOR_ALIGN = 64
"""Byte alignment of each tensor inside a store extent (a cache line: SIMD-friendly views)."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Parse a byte size such as ``512MiB``, ``64GiB``, ``1.5GB`` or ``4096`` into bytes.

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB … TiB) powers of 1024.
    Raises ConfigError naming ``what`` when the text is not a non-negative size.
    """
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{what} must be non-negative, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{what}: cannot read {text!r} as a size; write e.g. 512MiB, 64GiB or 1.5GB")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(nbytes: float, up: bool = False) -> str:
    """Format a byte count with a binary unit and one decimal, e.g. ``1.5 GiB``; ``up``: rounded up, not
    to nearest (a size something needs, which the figure shown must not undercut)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{math.ceil(nbytes) if up else round(nbytes)} B"
            return f"{math.ceil(nbytes * 10 - 1e-9) / 10 if up else nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def align_up(n: int, alignment: int) -> int:
    """Round ``n`` up to a multiple of ``alignment`` (a power of two)."""
    return (n + alignment - 1) & ~(alignment - 1)
