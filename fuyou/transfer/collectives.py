"""Data-parallel collectives between ranks: weights gathered in, gradients scattered out, scalars summed.

With ``world`` ranks (``torchrun``; ``join`` sets the process group up) every rank stores and
updates one shard of each block (``fuyou.schedule.shards``, ``ModelLayout(rank=, world=)``). Per block
and step:

* ``gather`` — the loader's uploaded shard → the whole (padded) block on every rank, before forward
  and again before backward (``all_gather_into_tensor``);
* ``scatter_gradient`` — the block's summed gradient → this rank's shard of the sum over ranks
  (``reduce_scatter_tensor``), whose squared norm joins the step's sum; the shard goes on to the
  Adam stage or is parked, as one rank's whole gradient would;
* ``sum_scalars`` — the step's loss and squared gradient norm summed over ranks (``all_reduce``) and
  read back: the step's one device→host read, so clipping is exact and a non-finite gradient on any
  rank skips the step on all.

Device collectives run on their own stream (``stream``), ordered after the work they read by events
and before the work that reads them by the events they return, so on a GPU they overlap compute
and copies (NCCL orders itself after the stream current at the call, and that stream after it).
They are issued from the training thread only, in the same order on every rank. Host-side
agreement (``any``, ``sum_int``, ``min_int``, ``gather_to_root``) goes over a separate gloo group on
host tensors. Every collective is timed on the timeline's ``comm`` resource with the bytes it moves
into this rank (``shards.collective_bytes``). One process is N = 1: ``join`` returns ``OneRank``, the
same interface whose collectives are what they are over one rank (the gradient is its own shard, sums
are the values), so no caller asks whether there are ranks; the few that choose a cheaper path for one
rank (the loader uploads straight into the block, a store commits without agreement) ask ``world``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from fuyou.device.base import Backend, Event
from fuyou.errors import ConfigError
from fuyou.optim.norm import read_scalars, sum_squares_lazy
from fuyou.timeline import Timeline

_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
"""torch ≥ 2.10's names of the tensor collectives (the older ones warn), else the older ones."""

FORCE_ENV = "FUYOU_COLLECTIVES"
"""``1``: one rank under torchrun still goes through the collectives (a check of the NCCL or gloo path
on one GPU or CPU: every collective is then a copy)."""

TIMEOUT_ENV = "FUYOU_COLLECTIVE_TIMEOUT"
"""Seconds a collective may wait for the other ranks before this rank gives up (default 600)."""


def world_size() -> int:
    """Ranks this process was launched among (``WORLD_SIZE``, as torchrun sets it; 1 without).

    Raises ConfigError if ``WORLD_SIZE`` is set but not a positive integer."""
    raw = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    try:
        world = int(raw)
    except ValueError:
        world = 0
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={raw!r} is not a positive number of ranks; launch with torchrun")
    return world


def timeout_s() -> float:
    """The collective timeout in seconds (``FUYOU_COLLECTIVE_TIMEOUT``, default 600); raises ConfigError
    for a value that is not a positive number."""
    raw = os.environ.get(TIMEOUT_ENV, "600")
    try:
        t = float(raw)
    except ValueError:
        t = 0.0
    if not t > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return t


def start_ranks(kind: str, device: torch.device | None = None) -> bool:
    """Whether this process is one of several ranks (or ``FUYOU_COLLECTIVES=1``); if so and no default
    process group is set up yet (a Trainer or script may have), set it up from torchrun's environment:
    NCCL for ``kind`` ``cuda`` (on ``device``), gloo otherwise, with the ``FUYOU_COLLECTIVE_TIMEOUT``
    timeout. Raises ConfigError when that environment is incomplete."""
    forced = os.environ.get(FORCE_ENV, "") == "1"
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1 or forced
    if world_size() == 1 and not forced:
        return False
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE is {world_size()} but {', '.join(missing)} is not set; launch the ranks with torchrun"
        )
    timeout = datetime.timedelta(seconds=timeout_s())
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", timeout=timeout, device_id=device)
    return True


class Collectives:
    """One rank's collectives; see the module docstring. ``rank``/``world`` are its place in them."""

    def __init__(self, backend: Backend, timeline: Timeline, group: Any, control: Any) -> None:
        self.backend, self.timeline = backend, timeline
        self.group, self.control = group, control
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.stream = backend.new_stream()
        """The stream device collectives are ordered on."""

    @classmethod
    def join(cls, backend: Backend, timeline: Timeline) -> Collectives:
        """This process's collectives when it is one of several ranks, else ``OneRank``.

        Uses the default process group if the caller (a Trainer, a script) set one up; otherwise sets
        it up from torchrun's environment (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``):
        NCCL on a GPU, gloo on CPU, with the ``FUYOU_COLLECTIVE_TIMEOUT`` timeout; one rank too with
        ``FUYOU_COLLECTIVES=1``. Raises ConfigError when the environment is incomplete.
        """
        device = backend.device if backend.name == "cuda" else None
        if not start_ranks(backend.name, device):
            return OneRank(backend)
        control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s()))
        return cls(backend, timeline, dist.group.WORLD, control)

    # ---------------------------------------------------------------- device data
    def _moved(self, shard: torch.Tensor) -> int:
        return (self.world - 1) * shard.numel() * shard.element_size()

    def gather(self, shard: torch.Tensor, full: torch.Tensor, after: Event, label: str) -> Event:
        """Fill ``full`` (``world ×`` the bytes of ``shard``, both flat device tensors of one dtype)
        with every rank's ``shard``, after ``after`` (the upload of ``shard``); returns an event after
        it. Both tensors are kept alive for the stream."""
        after.wait(self.stream)
        with self.timeline.device_span("comm", f"gather {label}", self.backend, self.stream, self._moved(shard)):
            with self.backend.on(self.stream):
                _ALL_GATHER(full, shard, group=self.group)
            self.backend.keep_alive(shard, self.stream)  # hazard: the loader drops the shard at once
            self.backend.keep_alive(full, self.stream)
        return self.backend.record(self.stream)

    def scatter_gradient(
        self, full: torch.Tensor, sq_sum: float | torch.Tensor, label: str
    ) -> tuple[torch.Tensor, Event | None, float | torch.Tensor]:
        """This rank's shard of the sum over ranks of ``full`` (a block's flat device gradient, whose
        backward is the work issued so far on the current stream), the event after it, and
        ``sq_sum`` plus the shard's squared norm (computed on the collectives' stream, lazily)."""
        n = full.numel() // self.world
        shard = self.backend.device_empty((n,), full.dtype, f"gradient shard of {label}", stream=self.stream)
        self.backend.record().wait(self.stream)  # hazard: reducing the gradient before backward wrote it
        with self.timeline.device_span("comm", f"scatter {label}", self.backend, self.stream, self._moved(shard)):
            with self.backend.on(self.stream):
                _REDUCE_SCATTER(shard, full, op=dist.ReduceOp.SUM, group=self.group)
                sq_sum = sq_sum + sum_squares_lazy(shard)
            self.backend.keep_alive(full, self.stream)  # hazard: the caller drops the full gradient at once
        return shard, self.backend.record(self.stream), sq_sum

    def sum_on_device(self, t: torch.Tensor, label: str) -> None:
        """Sum the device tensor ``t`` over ranks in place, after the work issued so far on the
        current stream; that stream waits for the sum (no host read)."""
        self.backend.record().wait(self.stream)  # hazard: summing before the current stream wrote t
        with self.timeline.device_span("comm", label, self.backend, self.stream, self._moved(t)):
            with self.backend.on(self.stream):
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
            self.backend.keep_alive(t, self.stream)
        self.backend.record(self.stream).wait(self.backend.current_stream())  # hazard: reading the sum early

    def sum_scalars(self, *values: float | torch.Tensor) -> list[float]:
        """``values`` (floats, or 0-d tensors on the device written by the current stream or this
        one) summed over ranks, as floats: one all-reduce and one device→host read."""
        self.backend.record().wait(self.stream)
        with self.backend.on(self.stream):
            dev = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
            t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=dev) for v in values])
            with self.timeline.device_span("comm", "sum scalars", self.backend, self.stream):
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
            return read_scalars(*t.unbind())

    # ---------------------------------------------------------------- host agreement
    def _host(self, value: int, op: Any) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.control)
        return int(t.item())

    def sum_int(self, value: int) -> int:
        """``value`` summed over ranks."""
        return self._host(value, dist.ReduceOp.SUM)

    def min_int(self, value: int) -> int:
        """The smallest ``value`` of any rank."""
        return self._host(value, dist.ReduceOp.MIN)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        return self._host(int(bool(flag)), dist.ReduceOp.MAX) > 0

    def gather_to_root(self, shard: torch.Tensor) -> torch.Tensor | None:
        """Every rank's host ``shard`` (equal sizes) concatenated in rank order on rank 0; None elsewhere."""
        out = [torch.empty_like(shard) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(shard, out, dst=0, group=self.control)
        return torch.cat(out) if out is not None else None

    def gather_everywhere(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's host ``shard`` (equal sizes) concatenated in rank order, on every rank."""
        out = [torch.empty_like(shard) for _ in range(self.world)]
        dist.all_gather(out, shard, group=self.control)
        return torch.cat(out)


class OneRank(Collectives):
    """The collectives of one process (N = 1): no process group, nothing moved, nothing timed."""

    def __init__(self, backend: Backend) -> None:  # noqa: D107 — no group: Collectives.__init__ is not called
        self.backend = backend
        self.rank, self.world = 0, 1

    def gather(self, shard: torch.Tensor, full: torch.Tensor, after: Event, label: str) -> Event:
        """Not called: one rank's loader uploads straight into the block."""
        raise RuntimeError("one rank gathers nothing: upload into the block itself")

    def scatter_gradient(
        self, full: torch.Tensor, sq_sum: float | torch.Tensor, label: str
    ) -> tuple[torch.Tensor, Event | None, float | torch.Tensor]:
        """The whole gradient is this rank's shard: ``full``, no event (nothing ran after backward), and
        ``sq_sum`` plus its squared norm (lazily, on the current stream)."""
        return full, None, sq_sum + sum_squares_lazy(full)

    def sum_on_device(self, t: torch.Tensor, label: str) -> None:
        """The sum over one rank is ``t``."""

    def sum_scalars(self, *values: float | torch.Tensor) -> list[float]:
        """``values`` as floats (one device→host read)."""
        return read_scalars(*values)

    def sum_int(self, value: int) -> int:
        return value

    def min_int(self, value: int) -> int:
        return value

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def gather_to_root(self, shard: torch.Tensor) -> torch.Tensor | None:
        return shard

    def gather_everywhere(self, shard: torch.Tensor) -> torch.Tensor:
        return shard
