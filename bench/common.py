"""Shared helpers for the bench/ scripts: hardware description, timing, JSON-lines output.

Every figure a bench reports is a ratio measured side by side in one run (see
``../shared/BENCHMARKS.md``); these helpers keep the machine description and the timing method the
same across scripts.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any


def cpu_model() -> str:
    """Return the CPU model name from /proc/cpuinfo (or platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def disk_info(path: str) -> dict[str, Any]:
    """Describe the filesystem holding ``path``: device, fs type, size and free bytes."""
    info: dict[str, Any] = {"path": path}
    try:
        out = subprocess.run(["df", "-T", "-B1", path], capture_output=True, text=True, check=True)
        fields = out.stdout.splitlines()[-1].split()
        info.update(device=fields[0], fstype=fields[1], size_bytes=int(fields[2]))
    except (OSError, subprocess.CalledProcessError, IndexError, ValueError):
        pass
    info["free_bytes"] = shutil.disk_usage(path).free
    return info


def hardware_info(paths: list[str] | None = None) -> dict[str, Any]:
    """Return the machine description every bench record carries."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": round(mem / 2**30, 1),
        "python": sys.version.split()[0],
        "gpu": None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():  # bench scripts may ask; fuyou/ only via device/cuda.py
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    if paths:
        info["disks"] = [disk_info(p) for p in paths]
    return info


def median_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> tuple[float, list[float]]:
    """Run ``fn`` ``warmup`` times, then ``repeats`` timed times; return (median seconds, all)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def emit(record: dict[str, Any], out: str | None = None) -> None:
    """Print one JSON line (and append it to ``out`` if given), stamped with the UTC time."""
    record = {"time": datetime.now(UTC).isoformat(timespec="seconds"), **record}
    line = json.dumps(record, sort_keys=False)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def device_memory(device: str, reset: bool = False, since: dict[str, Any] | None = None) -> dict[str, Any]:
    """The CUDA caching allocator's figures (bench scripts may ask ``torch.cuda``; ``fuyou/`` only in
    ``device/cuda.py``): peak allocated and reserved bytes since the last reset, reserved now, and the
    allocation retries and OOMs (counted from ``since``, an earlier result, when given). ``reset``
    resets the peaks first. Empty off CUDA."""
    import torch

    if device != "cuda" or not torch.cuda.is_available():
        return {}
    if reset:
        torch.cuda.reset_peak_memory_stats()
    s = torch.cuda.memory_stats()
    out = {
        "max_allocated_bytes": s.get("allocated_bytes.all.peak", 0),
        "max_reserved_bytes": s.get("reserved_bytes.all.peak", 0),
        "reserved_bytes": s.get("reserved_bytes.all.current", 0),
        "num_alloc_retries": s.get("num_alloc_retries", 0),
        "num_ooms": s.get("num_ooms", 0),
    }
    if since:
        for k in ("num_alloc_retries", "num_ooms"):
            out[k] -= since.get(k, 0)
    return out


ALLOWED_SKIPS = ("not installed", "could not import", "No module named")
"""Skip reasons a GPU run accepts: an optional package missing (kvikio, …), nothing else."""


def unexpected_skips(junit_xml: str, allowed: tuple[str, ...] = ALLOWED_SKIPS) -> tuple[int, int, list[str]]:
    """(tests run, tests skipped, ``"test: reason"`` of each skip whose reason names none of ``allowed``)
    from a pytest JUnit XML file."""
    import xml.etree.ElementTree as ET

    ran = skipped = 0
    bad = []
    for case in ET.parse(junit_xml).iter("testcase"):
        ran += 1
        for sk in case.iter("skipped"):
            skipped += 1
            reason = sk.get("message") or (sk.text or "").strip()
            if not any(w in reason for w in allowed):
                bad.append(f"{case.get('classname')}.{case.get('name')}: {reason}")
    return ran, skipped, bad
