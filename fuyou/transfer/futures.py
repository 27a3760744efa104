"""Small future combinators for chaining I/O without blocking the training thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from fuyou.device.base import Event


def done_future(value: object = None) -> Future:
    """A future that is already complete with ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f


def chain(first: Future, start: Callable[[], Future]) -> Future:
    """A future for ``start()``'s future, where ``start`` is called only once ``first`` succeeded.

    ``start`` runs in the thread that completes ``first`` (or here, if it is already done). Errors
    of either stage land in the returned future.
    """
    out: Future = Future()

    def relay(f: Future) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(f.result())

    def go(f: Future) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
            return
        try:
            start().add_done_callback(relay)
        except BaseException as e:  # noqa: BLE001 - surfaced through the future
            out.set_exception(e)

    first.add_done_callback(go)
    return out


_waiters: dict[str, queue.SimpleQueue[tuple[Event, Future]]] = {}
"""One queue (and daemon thread) per channel: a channel's events complete in order, so one thread
each waits for them without holding another channel's back."""
_waiters_lock = threading.Lock()


def _wait_events(waits: queue.SimpleQueue[tuple[Event, Future]]) -> None:
    """A channel's waiter thread: completes each queued future once its event has (in queue order)."""
    while True:
        ev, fut = waits.get()
        try:
            ev.wait()
        except BaseException as e:  # noqa: BLE001 - surfaced through the future
            fut.set_exception(e)
        else:
            fut.set_result(None)
        del ev, fut


def event_future(ev: Event, channel: str) -> Future:
    """A future that completes when the device work before ``ev`` has (at once if it already has).

    A daemon thread per ``channel`` blocks on that channel's events in the order given, so the
    training thread never does: give each stream its own channel and its events in issue order (a
    later event on the same stream waits no longer). Errors of the work (``Event.wait`` raising) land
    in the future.
    """
    fut: Future = Future()
    if ev.query():
        try:
            ev.wait()  # done: returns at once, or raises the work's error
        except BaseException as e:  # noqa: BLE001 - surfaced through the future
            fut.set_exception(e)
        else:
            fut.set_result(None)
        return fut
    with _waiters_lock:
        waits = _waiters.get(channel)
        if waits is None:
            waits = _waiters[channel] = queue.SimpleQueue()
            name = f"fuyou-event-waiter-{channel}"
            threading.Thread(target=_wait_events, args=(waits,), name=name, daemon=True).start()
    waits.put((ev, fut))
    return fut
