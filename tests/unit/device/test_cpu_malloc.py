"""The CPU backend keeps torch's freed temporaries in the process: a step-like burst of large
allocations stops page-faulting once the heap holds it (glibc only; child processes, since the
setting is process-wide)."""

import os
import platform
import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys, torch
from fuyou.device import get_backend, cpu_malloc
get_backend("cpu")
def burst():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.empty(5 << 20, dtype=torch.float32).fill_(1) for _ in range(40)]  # 40 x 20 MB, like kept activations
    del xs
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print(cpu_malloc.keep_freed_memory(), *[burst() for _ in range(4)])
"""


def run_child(**env: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, env={**os.environ, **env}
    )
    return out.stdout.split()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc settings")
def test_freed_memory_is_reused_without_page_faults():
    applied, first, *later = run_child()
    assert applied == "True"
    assert int(first) > 100_000  # 800 MB touched for the first time: ~200 k faults of 4 KiB pages
    assert int(later[-1]) < int(first) // 20, (first, later)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc settings")
def test_system_malloc_when_asked():
    applied, first, *later = run_child(FUYOU_CPU_MALLOC="system")
    assert applied == "False"
    assert int(later[0]) > int(first) // 2  # glibc gives the blocks back and re-faults them (until its
    # dynamic mmap threshold has grown past the block size)
