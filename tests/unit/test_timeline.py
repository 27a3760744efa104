"""The timeline: host spans, device-timed spans, union busy time and the bottleneck."""

from __future__ import annotations

import threading
import time

import torch

from fuyou.device import CPUBackend
from fuyou.device.cpu_async import AsyncCPUBackend
from fuyou.timeline import Timeline, union_length


def test_union_counts_overlapping_spans_once():
    assert union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0


def test_device_span_times_the_copy_when_the_stream_runs_it_not_when_it_was_issued():
    """The copy is issued at once but its stream is held for 0.2 s: a host-clock span would say the
    h2d resource was busy for microseconds at issue time; the device-timed span sits where the copy ran."""
    b = AsyncCPUBackend(max_delay=0.0)
    s = b.new_stream()
    tl = Timeline()
    gate = threading.Event()
    s.put(gate.wait)
    host, dev = b.host_empty(1 << 20), b.device_empty((1 << 20,), torch.uint8, "w", stream=s)
    t_issue = time.perf_counter()
    with tl.device_span("h2d", "w", b, s, 1 << 20):
        ev = b.copy(dev, host, s)
    b.keep_alive(dev, None)
    tl.resolve()
    assert tl.spans == [], "a span is resolved only once the device has reached its events"
    time.sleep(0.2)
    t_release = time.perf_counter()
    gate.set()
    ev.wait()
    t0 = time.perf_counter()
    summary = tl.summary(t_issue, t0 + 1)
    (span,) = tl.spans
    assert t_release <= span.t0 <= span.t1 <= t0
    assert summary["busy_s"]["h2d"] < 0.1
    assert span.t0 - t_issue >= 0.2


def test_on_the_plain_cpu_backend_device_spans_are_host_spans():
    b, tl = CPUBackend(), Timeline()
    t = time.perf_counter()
    with tl.device_span("compute", "matmul", b, None):
        time.sleep(0.05)
    s = tl.summary(t, time.perf_counter())
    assert 0.05 <= s["busy_s"]["compute"] < 0.5 and s["bottleneck"] == "compute"


def test_bytes_count_in_the_step_they_serve_when_issued_whatever_the_timing():
    """A write issued in step 1 counts there, even if it lands after the step; a write issued later
    for step 1 (an update after its step's end, on another thread, naming the step) does too; a read issued between steps counts outside them (None); each counts once."""
    from concurrent.futures import Future

    tl = Timeline()
    key = tl.begin_step()
    late: Future = Future()
    tl.track(late, "ssd_write", "s/a", 100)  # lands after the step
    tl.end_step()
    tl.track(Future(), "ssd_read", "w/eval", 7)  # an evaluation between steps

    def update() -> None:
        tl.track(Future(), "ssd_read", "s/b", 10, key)

    t = threading.Thread(target=update)
    t.start()
    t.join()
    tl.track(Future(), "ssd_write", "w/b", 5, key)  # a callback thread naming the step
    two = tl.begin_step()
    late.set_result(None)  # landing in step 2 changes nothing
    tl.end_step()
    assert tl.take_bytes(key) == {"ssd_read": 10, "ssd_write": 105, "comm": 0}
    assert tl.take_bytes(key) == {"ssd_read": 0, "ssd_write": 0, "comm": 0}, "taken once"
    assert tl.take_bytes(two)["ssd_write"] == 0
    assert tl.take_bytes(None)["ssd_read"] == 7
    assert "ssd_write_bytes" not in tl.summary(0.0, time.perf_counter())


def test_a_wait_inside_a_compute_span_is_not_compute():
    """Compute waiting for another stream's copy (``gap``: an activation's copy back) is cut out of the
    compute span: 0.1 s of work around a 0.15 s wait is 0.1 s busy, not 0.25 s."""
    b, tl = CPUBackend(), Timeline()
    t = time.perf_counter()
    with tl.device_span("compute", "bwd", b, None):
        time.sleep(0.05)
        with tl.gap(None):
            time.sleep(0.15)
        time.sleep(0.05)
    busy = tl.summary(t, time.perf_counter())["busy_s"]["compute"]
    assert 0.1 <= busy < 0.2
    assert len(tl.spans) == 2


def test_a_copy_the_step_issued_that_lands_after_its_end_counts_in_that_step_only():
    """The step's last device→host copy is still queued at step end: the summary waits for it and
    counts it whole in the step that issued it; the next step does not count it again."""
    b = AsyncCPUBackend(max_delay=0.0)
    s = b.new_stream()
    tl = Timeline()
    gate = threading.Event()
    t0 = time.perf_counter()
    s.put(gate.wait)
    host, dev = b.host_empty(1 << 20), b.device_empty((1 << 20,), torch.uint8, "g", stream=s)
    with tl.device_span("d2h", "grad", b, s, 1 << 20):
        b.copy(host, dev, s)
    s.put(lambda: time.sleep(0.1))  # the copy's stream is busy past the step's end
    with tl.device_span("d2h", "grad 2", b, s, 1 << 20):
        b.copy(host, dev, s)
    t1 = time.perf_counter()
    threading.Timer(0.05, gate.set).start()
    first = tl.summary(t0, t1)
    assert [sp.label for sp in tl.spans] == ["grad", "grad 2"], "both resolved in the step that issued them"
    assert all(sp.t1 > t1 for sp in tl.spans)
    assert first["busy_s"]["d2h"] > 0
    second = tl.summary(t1, time.perf_counter() + 1)
    assert second["busy_s"]["d2h"] == 0.0


def test_ram_copies_are_their_own_resource_in_summary_and_trace(tmp_path):
    """A host-memory copy (the RAM tier) is neither h2d nor d2h: it has its own row and busy time."""
    import json

    from fuyou.timeline import RESOURCES

    tl = Timeline()
    t = time.perf_counter()
    tl.add("ram_copy", "ram→host w/layer.0", t, t + 0.1, 100)
    s = tl.summary(t, t + 0.2)
    assert "ram_copy" in RESOURCES and s["busy_s"]["h2d"] == 0.0
    assert abs(s["busy_s"]["ram_copy"] - 0.1) < 1e-9
    tl.to_chrome_trace(str(tmp_path / "t.json"))
    events = json.load(open(tmp_path / "t.json"))["traceEvents"]
    rows = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"}
    assert [e["tid"] for e in events if e["ph"] == "X"] == [rows["ram_copy"]]


def test_a_wait_on_another_thread_is_cut_out_of_the_span_open_on_its_stream():
    """On a GPU autograd runs backward's unpack hooks (where compute waits for an activation's copy
    back) on its own device thread: the gap applies to the compute span whichever thread opened it."""
    b, tl = CPUBackend(), Timeline()
    t = time.perf_counter()

    def hook() -> None:
        with tl.gap(None):
            time.sleep(0.15)

    with tl.device_span("compute", "bwd", b, None):
        time.sleep(0.05)
        th = threading.Thread(target=hook)
        th.start()
        th.join()
    assert 0.05 <= tl.summary(t, time.perf_counter())["busy_s"]["compute"] < 0.12
