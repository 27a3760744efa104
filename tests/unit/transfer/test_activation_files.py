"""Activations swapped to SSD come back only once their read has landed (``activation_files``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fuyou.device import CPUBackend
from fuyou.device.base import Backend
from fuyou.storage.io_posix import PosixIO
from fuyou.timeline import Timeline
from fuyou.transfer.activation_files import ActivationSpace, SSDRecord
from fuyou.transfer.host_pool import HostBufferPool


class SlowReads(PosixIO):
    """A drive whose reads land 50 ms late (the future completes when they have)."""

    def _read_block(self, raw, h, arr, offset):
        time.sleep(0.05)
        super()._read_block(raw, h, arr, offset)


SAVED = (torch.arange(1000.0), torch.full((3, 7), -2.5))


def written_out(space: ActivationSpace) -> tuple[SSDRecord, list[int]]:
    """A record of ``SAVED`` whose write has landed and whose host copy is gone; its indices."""
    rec = SSDRecord(space, block=0, micro=0)
    idx = [rec.pack(t) for t in SAVED]
    rec.flush()
    deadline = time.monotonic() + 10
    while rec.staging is not None and time.monotonic() < deadline:  # the write lands, the host copy goes
        time.sleep(0.005)
    assert rec.staging is None
    return rec, idx


@contextmanager
def slow_space(backend: Backend, tmp_path) -> Iterator[ActivationSpace]:
    """An activation space over ``SlowReads`` in ``tmp_path``, closed (streams drained) afterwards."""
    io = SlowReads(threads=2)
    space = ActivationSpace(backend, HostBufferPool(backend, 1 << 20), io, [str(tmp_path)], [False], Timeline())
    try:
        yield space
    finally:
        backend.synchronize()
        space.close()
        io.shutdown()


def test_unpack_waits_for_the_read_back(tmp_path):
    with slow_space(CPUBackend(), tmp_path) as space:
        rec, idx = written_out(space)
        rec.prefetch()  # the read back starts (slowly)
        for i, t in zip(idx, SAVED):
            assert torch.equal(rec.unpack(i), t)
        rec.release()


def test_copies_back_start_on_the_copy_stream_once_the_read_landed(tmp_path):
    """Under the asynchronous backend: ``upload`` before the read lands reserves the tensors' device
    memory (so the device's peak does not depend on the SSD's timing) and issues no copy; after it,
    each tensor's copy back is queued on the host-to-device stream (an event not yet complete: the
    training thread did not copy), and the unpack hook returns the data once its copy ran."""
    from fuyou.device.cpu_async import AsyncCPUBackend

    backend = AsyncCPUBackend(max_delay=0.05, arena=False)
    with slow_space(backend, tmp_path) as space:
        rec, idx = written_out(space)
        before = backend.memory().allocated
        rec.upload()  # starts the (slow) read back; it has not landed: memory reserved, no copies yet
        assert rec.io is not None and not rec.io.done()
        assert rec.back is not None and all(c.ready is None for c in rec.back) and not rec.started
        assert backend.memory().allocated - before == sum(t.numel() * t.element_size() for t in SAVED)
        rec.io.result()
        rec.upload()
        assert rec.started and len(rec.back) == 2
        assert not all(c.ready.query() for c in rec.back)  # queued on the stream, after a random delay
        for i, t in zip(idx, SAVED):
            assert torch.equal(rec.unpack(i), t)
        rec.release()
