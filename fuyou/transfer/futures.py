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


_waits: queue.SimpleQueue[tuple[Event, Future]] = queue.SimpleQueue()
_waiter: threading.Thread | None = None
_waiter_lock = threading.Lock()


def _wait_events() -> None:
    """The waiter thread: completes each queued future once its event has (in queue order)."""
    while True:
        ev, fut = _waits.get()
        try:
            ev.wait()
        except BaseException as e:  # noqa: BLE001 - surfaced through the future
            fut.set_exception(e)
        else:
            fut.set_result(None)
        del ev, fut


def event_future(ev: Event) -> Future:
    """A future that completes when the device work before ``ev`` has (at once if it already has).

    One daemon thread blocks on the events in the order given, so the training thread never does:
    pass events of one stream in issue order (a later event on the same stream waits no longer).
    Errors of the work (``Event.wait`` raising) land in the future.
    """
    global _waiter
    fut: Future = Future()
    if ev.query():
        try:
            ev.wait()  # done: returns at once, or raises the work's error
        except BaseException as e:  # noqa: BLE001 - surfaced through the future
            fut.set_exception(e)
        else:
            fut.set_result(None)
        return fut
    with _waiter_lock:
        if _waiter is None:
            _waiter = threading.Thread(target=_wait_events, name="fuyou-event-waiter", daemon=True)
            _waiter.start()
    _waits.put((ev, fut))
    return fut
