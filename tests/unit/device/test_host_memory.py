"""Host buffers stay out of forked children (MADV_DONTFORK), and every backend reports reserved memory."""

import gc
import mmap
import os
import sys

import pytest
import torch

from fuyou.device import CPUBackend, cpu_arena, host_aligned_empty
from fuyou.device.cpu_async import AsyncCPUBackend

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTFORK"), reason="MADV_DONTFORK is Linux's"
)


def vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping holding ``addr`` in /proc/self/smaps (empty if none holds it)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    return set()


def mapped_in_child(*addrs: int) -> list[bool]:
    """Whether a forked child sees a mapping at each of ``addrs`` (it reads its own /proc/self/maps and
    reports one exit-status bit per address; it never touches the memory)."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no torch, just the answer
        code = 0
        try:
            spans = []
            with open("/proc/self/maps") as f:
                for line in f:
                    lo, hi = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
                    spans.append((lo, hi))
            for i, a in enumerate(addrs):
                if any(lo <= a < hi for lo, hi in spans):
                    code |= 1 << i
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return [bool(code >> i & 1) for i in range(len(addrs))]


@linux_only
@pytest.mark.parametrize("make", ["aligned", "cpu", "cpu-unpinned", "cpu-async"])
def test_host_buffers_are_marked_dont_fork(make):
    """Every host buffer's mapping carries the ``dc`` (don't copy on fork) flag, pinned or not."""
    t = {
        "aligned": lambda: host_aligned_empty(3 << 20),
        "cpu": lambda: CPUBackend().host_empty(3 << 20),
        "cpu-unpinned": lambda: CPUBackend().host_empty(3 << 20, pinned=False),
        "cpu-async": lambda: AsyncCPUBackend().host_empty(3 << 20, pinned=False),
    }[make]()
    assert "dc" in vm_flags(t.data_ptr()) and "dc" in vm_flags(t.data_ptr() + (3 << 20) - 1)


@linux_only
def test_a_forked_child_does_not_inherit_host_buffers():
    """A DataLoader worker forked from the trainer gets none of its host buffers; an ordinary mapping
    (the control) it does get, so the check is not vacuous."""
    buf = host_aligned_empty(1 << 20)
    buf.fill_(7)
    plain = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    control = torch.frombuffer(plain, dtype=torch.uint8)
    control.fill_(7)
    assert mapped_in_child(buf.data_ptr(), buf.data_ptr() + (1 << 20) - 1, control.data_ptr()) == [False, False, True]
    assert int(buf.sum()) == 7 << 20, "the parent's buffer is untouched by the fork"
    del control
    plain.close()


def test_host_empty_takes_the_pinned_request_on_cpu_backends():
    """``pinned`` is a request the CPU backends accept either way: same exact-size, aligned buffer."""
    for b in (CPUBackend(), AsyncCPUBackend()):
        for pinned in (True, False):
            t = b.host_empty(4097, pinned=pinned)
            assert t.numel() == 4097 and t.dtype == torch.uint8 and t.data_ptr() % 4096 == 0 and not t.is_pinned()


def test_reserved_is_live_plus_the_arenas_cache():
    if not cpu_arena.SUPPORTED:
        pytest.skip("this torch build lacks storage use counts / data-pointer swaps")
    b = CPUBackend(capacity=64 << 20)
    t = b.device_empty((1 << 20,), torch.float32, "a")
    m = b.memory()
    assert (m.allocated, m.reserved) == (4 << 20, 4 << 20)
    del t
    gc.collect()
    m = b.memory()
    assert m.allocated == 0 and m.reserved == 4 << 20, "the freed block stays cached: reserved, not allocated"
    again = b.device_empty((1 << 20,), torch.float32, "b")
    m = b.memory()
    assert (m.allocated, m.reserved) == (4 << 20, 4 << 20), "served from the cache: nothing more reserved"
    del again


def test_reserved_is_allocated_without_the_arena(monkeypatch):
    monkeypatch.setattr(cpu_arena, "SUPPORTED", False)
    b = CPUBackend(capacity=64 << 20)
    assert b._arena is None
    t = b.device_empty((1000,), torch.uint8)
    m = b.memory()
    assert m.allocated == m.reserved == 1000
    del t
    gc.collect()
    assert b.memory().reserved == 0


@pytest.mark.parametrize("arena", [True, False])
def test_async_backend_reports_reserved_as_the_plain_one(arena):
    if arena and not cpu_arena.SUPPORTED:
        pytest.skip("this torch build lacks storage use counts / data-pointer swaps")
    b = AsyncCPUBackend(capacity=64 << 20, arena=arena)
    t = b.device_empty((4096,), torch.uint8)
    m = b.memory()
    assert m.reserved >= m.allocated == 4096
    del t
