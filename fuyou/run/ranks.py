"""A run's data-parallel ranks, for ``fuyou finetune`` under ``torchrun``: who this process is, what
only rank 0 does, and how the ranks agree before the engine exists.

``join`` sets up the default process group from torchrun's environment (NCCL on a GPU, gloo on CPU;
the engine's ``Collectives`` then use it) and a gloo group for host-side agreement. One process
(no ``WORLD_SIZE`` > 1) gets ``Ranks.single()``, whose agreement calls return their input. Rank 0
alone writes the run directory's shared files (metrics, ``run.json``, ``model/``, the checkpoint
markers) and chooses the plan, which the others receive (``share``), so every rank runs the same one.
A rank that dies makes the others' next collective fail (gloo: the connection closes; otherwise the
``FUYOU_COLLECTIVE_TIMEOUT``): ``lost`` turns that into one clear line.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fuyou.errors import FuyouError

T = TypeVar("T")

PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "gloo/transport", "Timed out waiting")
"""What gloo's plain RuntimeErrors say when a peer rank died or never answered."""


class RankLostError(FuyouError):
    """Another rank of the run stopped (crashed, killed, or unreachable) during a collective."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's ranks; ``group``: the host agreement group (None alone)."""

    rank: int
    world: int
    local_rank: int
    group: Any = None
    owned: bool = False
    """Whether ``join`` set up the default process group (not a caller before it): ``close`` tears it down."""

    @staticmethod
    def single() -> Ranks:
        """One process."""
        return Ranks(0, 1, 0)

    @property
    def root(self) -> bool:
        """Whether this is rank 0 (which writes the run directory's shared files)."""
        return self.rank == 0

    def share(self, value: T | None) -> T:
        """Rank 0's ``value`` (not None) on every rank: any picklable object; the others pass None."""
        if self.world == 1:
            assert value is not None
            return value
        import torch.distributed as dist

        box: list[Any] = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def decide(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on rank 0 and its result on every rank; a FuyouError there (a budget that does
        not fit, a bad profile) is raised on every rank, so none waits for a rank 0 that stopped."""
        if self.world == 1:
            return fn()
        out: Any = None
        if self.root:
            try:
                out = ("ok", fn())
            except FuyouError as e:
                out = ("error", e)
        kind, value = self.share(out)
        if kind == "error":
            raise value
        return value

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order, on every rank."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank."""
        return all(self.gather(bool(ok)))

    def barrier(self) -> None:
        """Wait until every rank is here."""
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def close(self) -> None:
        """After the run's last collective: destroy the process groups ``join`` set up, so their
        threads (gloo) and pending work (NCCL) end before the interpreter does, not in its teardown."""
        if self.owned:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def join(device: str) -> Ranks:
    """This process's ranks: ``Ranks.single()`` without a multi-process launch, else the process group
    set up from torchrun's environment (``device``: ``cuda`` or ``cpu``, the backend kind). Raises
    ConfigError when the launch environment is incomplete (``collectives.start_ranks``)."""
    import torch
    import torch.distributed as dist

    from fuyou.transfer.collectives import start_ranks, timeout_s

    local = int(os.environ.get("LOCAL_RANK", "0"))
    owned = not (dist.is_available() and dist.is_initialized())
    if not start_ranks(device, torch.device("cuda", local) if device == "cuda" else None):
        return Ranks.single()
    timeout = datetime.timedelta(seconds=timeout_s())
    group = dist.new_group(backend="gloo", timeout=timeout)
    return Ranks(dist.get_rank(), dist.get_world_size(), local, group, owned)


def lost(e: BaseException) -> RankLostError | None:
    """The one-line error for a collective that failed because another rank is gone, or None when
    ``e`` is not such a failure."""
    import torch.distributed as dist

    msg = str(e)
    gloo = isinstance(e, RuntimeError) and any(m in msg for m in PEER_GONE)
    if not (isinstance(e, dist.DistError) or gloo):
        return None
    first = (msg.strip().splitlines() or [""])[0].split("] ", 1)[-1][:160]
    return RankLostError(
        f"another rank of this run stopped or cannot be reached ({first}); every rank stops: fix the "
        "cause, then start the run again with --resume auto (all ranks resume from their last common "
        "checkpoint)"
    )
