"""What a GPU would hold, counted on the CPU backend: every storage torch allocates during compute.

On CUDA the caching allocator sees every tensor forward and backward create — activations, the
tensors autograd saves, logits, temporaries — so ``--gpu-memory`` caps all of them. On the CPU
backend the "device" is host RAM and only the engine's own buffers (``Backend.device_empty``) used
to be charged against the fake capacity, so a plan that would overflow a GPU ran on CPU.

``Allocations`` is a ``TorchDispatchMode`` the CPU backend enters around compute
(``Backend.counting``): after each ATen op it charges every output storage that is new (not an
input's storage, not one already charged, not the arena's own) against the same capacity, and
refunds it when the storage is freed (a weak reference with a callback on the storage object, which
torch keeps alive as long as the storage). An op whose output passes the capacity raises the one-line
``DeviceMemoryError`` naming the op and the compute it belongs to — where a GPU would raise its
out-of-memory error. The mode is per thread (torch's dispatch-mode stack is thread-local) and
autograd runs a CPU backward on the calling thread, so backward's allocations are counted too.
Host allocations made inside compute (staging for swapped activations) are not device memory:
the backend makes them under ``paused``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Charger = Callable[[torch.UntypedStorage, object], None]
"""Charges a new storage (its ``nbytes()``) against the fake capacity and refunds it when freed;
raises DeviceMemoryError naming the object (its ``str``) past the capacity (``CachingArena.adopt``)."""


class _Op:
    """What allocated a storage — an op in a region of compute — formatted only if an error names it."""

    __slots__ = ("func", "region")

    def __init__(self, func: Any, region: str) -> None:
        self.func, self.region = func, region

    def __str__(self) -> str:
        return f"{self.func.__name__} in {self.region}"


class Allocations(TorchDispatchMode):
    """Charges the storages ops allocate on this thread to ``charge``; ``what`` names the compute."""

    def __init__(self, charge: Charger, what: str) -> None:
        super().__init__()
        self.charge, self.what = charge, what

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(_local, "paused", 0):
            return out
        outs = (out,) if type(out) is torch.Tensor else tree_leaves(out)  # the common case without pytree
        known: set[int] | None = None
        for t in outs:
            if not isinstance(t, torch.Tensor) or t.is_sparse:
                continue
            s = t.untyped_storage()
            if not s.nbytes():
                continue
            if known is None:
                known = _storages(args, kwargs)
            if id(s) not in known:
                known.add(id(s))
                self.charge(s, _Op(func, self.what))
        return out


def _storages(args: tuple, kwargs: dict | None) -> set[int]:
    """Ids of the storages of the tensors and storages among an op's inputs (one level of lists)."""
    out = set()
    for a in (*args, *(kwargs.values() if kwargs else ())):
        for t in a if isinstance(a, list | tuple) else (a,):
            if isinstance(t, torch.Tensor):
                if not t.is_sparse:
                    out.add(id(t.untyped_storage()))
            elif isinstance(t, torch.UntypedStorage):
                out.add(id(t))
    return out


_local = threading.local()


@contextmanager
def paused() -> Iterator[None]:
    """Allocations made on this thread inside are host memory, not the device's (nestable)."""
    _local.paused = getattr(_local, "paused", 0) + 1
    try:
        yield
    finally:
        _local.paused -= 1
