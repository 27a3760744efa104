"""What this machine is, and a small per-machine cache of measurements that take seconds.

Measurements that depend only on the hardware and the installed torch (is bf16 matmul fast here?
how fast are the SSD, the CPU Adam, one decoder layer of this model?) are taken once per machine
and kept in ``$FUYOU_CACHE`` (default ``~/.cache/fuyou``), keyed by ``machine_key``: a new CPU
model, CPU flags, torch version or ISA override (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``)
is a new machine. A cache that cannot be read or written is ignored (measured again), never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import tempfile
from collections.abc import Callable
from typing import Any

ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA")
"""Environment variables that change which CPU kernels torch runs (so: a different machine)."""


def cache_dir() -> str:
    """``$FUYOU_CACHE`` or ``~/.cache/fuyou``."""
    return os.environ.get("FUYOU_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "fuyou"))


def cpu_description() -> tuple[str, tuple[str, ...]]:
    """(CPU model name, sorted CPU flags) from ``/proc/cpuinfo``; (platform name, ()) elsewhere."""
    model, flags = platform.processor() or platform.machine(), ()
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return model, flags
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    feats = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.M)
    if found:
        model = found.group(1).strip()
    if feats:
        flags = tuple(sorted(feats.group(1).split()))
    return model, flags


def machine_key(device: str) -> str:
    """A short hash naming this machine for ``device`` (``cpu``/``cuda`` + GPU name): CPU model and
    flags, torch version, core count and the ISA override variables."""
    import torch

    model, flags = cpu_description()
    parts = [device, model, " ".join(flags), torch.__version__, str(os.cpu_count())]
    parts += [f"{k}={os.environ.get(k, '')}" for k in ISA_ENV]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _path(name: str) -> str:
    return os.path.join(cache_dir(), f"{name}.json")


def cache_get(name: str, key: str) -> Any | None:
    """The value cached under ``key`` in the cache file ``name``, or None if absent or unreadable."""
    try:
        with open(_path(name)) as f:
            return json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def cache_put(name: str, key: str, value: Any) -> None:
    """Store ``value`` (JSON data) under ``key`` in cache file ``name``, atomically; errors are ignored
    (a read-only home directory only costs a measurement next time)."""
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        try:
            with open(_path(name)) as f:
                doc = json.load(f)
            doc = doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            doc = {}
        doc[key] = value
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=cache_dir())
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, _path(name))
    except OSError:
        pass


def cache_drop(name: str, key: str) -> None:
    """Forget the value cached under ``key`` in cache file ``name`` (measured again when next asked for);
    errors are ignored, as ``cache_put``'s."""
    try:
        with open(_path(name)) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.pop(key, None) is None:
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=cache_dir())
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, _path(name))
    except (OSError, ValueError):
        pass


def cached(name: str, key: str, measure: Callable[[], Any]) -> tuple[Any, bool]:
    """``(value, was_cached)``: the cached value for ``key`` in ``name``, else ``measure()`` stored there."""
    value = cache_get(name, key)
    if value is not None:
        return value, True
    value = measure()
    cache_put(name, key, value)
    return value, False
