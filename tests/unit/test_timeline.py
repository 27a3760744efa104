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


def test_bytes_count_once_in_the_summary_after_they_complete():
    """A write that finishes between two steps (or after a ``clear``) counts in the next step's summary;
    none counts twice, whatever the windows."""
    tl = Timeline()
    t = time.perf_counter()
    tl.add("ssd_write", "w/a", t, t + 0.1, 100)
    first = tl.summary(t, t + 0.05)  # the write outlived this window: counted here, where it completed first
    tl.add("ssd_write", "w/b", t + 0.2, t + 0.3, 10)  # between the windows
    tl.clear()
    tl.add("ssd_read", "w/c", t + 0.4, t + 0.5, 7)
    second = tl.summary(t + 0.4, t + 0.6)
    third = tl.summary(t + 0.6, t + 0.7)
    assert (first["ssd_write_bytes"], second["ssd_write_bytes"], third["ssd_write_bytes"]) == (100, 10, 0)
    assert (first["ssd_read_bytes"], second["ssd_read_bytes"], third["ssd_read_bytes"]) == (0, 7, 0)
