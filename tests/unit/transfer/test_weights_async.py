"""The weight loader under the asynchronous CPU backend: uploads never hold the training thread back."""

from __future__ import annotations

import threading

from fuyou.device import cpu_async
from fuyou.device.cpu_async import AsyncCPUBackend
from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.schedule import rules
from fuyou.transfer.futures import event_future
from tests.integration.tiny_models import tiny


def test_event_future_completes_after_the_streams_work():
    b = AsyncCPUBackend(max_delay=0.0)
    s = b.new_stream()
    gate = threading.Event()
    s.put(gate.wait)
    fut = event_future(b.record(s), "test")
    assert not fut.done()
    gate.set()
    assert fut.result(timeout=5) is None
    assert event_future(b.record(), "test").done(), "an event already complete gives a completed future"


def test_the_next_block_is_handed_over_while_every_upload_is_still_queued(monkeypatch, tmp_path):
    """With the copy stream held, every host buffer ends up holding an upload in flight. ``next`` must
    still return the blocks already read (the upload queued, the following read deferred to the
    buffer's release), never block the training thread on an upload: the read it needs is the only wait."""
    monkeypatch.setenv(cpu_async.ENV, "arena")
    cfg, model = tiny("llama", layers=4)
    depth = 2
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),),
        precision="fp32",
        cpu_memory="256MiB",
        plan=Plan(prefetch_depth=depth, activation_policy=("keep",) * 6),
    )
    with Engine.from_state_dict(cfg, model.state_dict(), ec) as eng:
        assert isinstance(eng.backend, AsyncCPUBackend)
        loader = eng.loader
        order = rules.load_order(len(eng.layout.blocks), [])
        gate = threading.Event()
        loader.stream.put(gate.wait)  # no upload can land until the gate opens
        loader.start(order)
        got: list = []
        worker = threading.Thread(target=lambda: got.extend(loader.next(b) for b in order[: depth + 1]))
        worker.start()
        worker.join(10)
        held = worker.is_alive()
        gate.set()
        worker.join(10)
        assert not held, "next() waited for an upload to land (host blocked on back-pressure)"
        assert len(got) == depth + 1
        loader.drain()
