"""Small future combinators for chaining I/O without blocking the training thread."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future


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
