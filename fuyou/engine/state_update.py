"""How the Adam stage updates one run of a state chunk, by optimizer-state format — one class per way the
master is kept (``fuyou.schedule.state_format``), chosen once at assembly (``for_format``):

* ``MasterInState`` — an fp32 master in the chunk (``fp32``, ``fp32-bf16``): the kernel writes the new bf16
  weights as it goes (fp32 weights: a copy of the master after the kernel).
* ``SplitMaster`` — the master is the block's compute weights plus the chunk's remainders (``split``,
  ``bf16``): the stage reads the old weights into the new-weights buffer first (``reads_weights``) and the
  kernel rewrites them in place (``adamw_split_step``); beside fp32 weights the weights *are* the master.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fuyou.optim import AdamJob, adamw_split_step, adamw_step
from fuyou.schedule.state_format import StateFormat

OnDone = Callable[[AdamJob], None] | None


@dataclass(frozen=True)
class MasterInState:
    """An fp32 master vector of its own in every state chunk."""

    compute: torch.dtype
    reads_weights = False
    """The update needs the block's old compute weights in the new-weights buffer first."""

    def step(self, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, **kw: Any) -> bool:
        """The update function the Adam worker runs on a job's buffers (``adamw_step``)."""
        return adamw_step(master, m, v, grad, **kw)

    def job(
        self, views: dict[str, torch.Tensor], a: int, z: int, out: torch.Tensor, **kw: Any
    ) -> tuple[AdamJob, OnDone]:
        """The job for elements [a, z) of a chunk's ``views``, the new weights going to ``out`` (those
        elements of the new-weights buffer), and what runs after it; ``kw``: the job's other fields."""
        bf16 = self.compute == torch.bfloat16
        job = AdamJob(
            master=views["master"][a:z], m=views["m"][a:z], v=views["v"][a:z], out=out if bf16 else None, **kw
        )

        def copy_out(j: AdamJob) -> None:  # fp32 weights: the new master itself
            out.copy_(j.master)

        return job, (None if bf16 else copy_out)


@dataclass(frozen=True)
class SplitMaster:
    """The master as the compute weights plus a remainder (``fuyou.optim.split``)."""

    compute: torch.dtype
    reads_weights = True

    def step(self, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, **kw: Any) -> bool:
        """``adamw_split_step`` on the remainders and the weights in ``out``; beside fp32 weights, which are
        the master, ``adamw_step`` on them."""
        if self.compute == torch.float32:
            return adamw_step(master, m, v, grad, **kw)
        return adamw_split_step(master, m, v, grad, **kw)

    def job(
        self, views: dict[str, torch.Tensor], a: int, z: int, out: torch.Tensor, **kw: Any
    ) -> tuple[AdamJob, OnDone]:
        """As ``MasterInState.job``; ``out`` holds the old weights and receives the new ones in place."""
        if self.compute == torch.float32:
            return AdamJob(master=out, m=views["m"][a:z], v=views["v"][a:z], **kw), None
        return AdamJob(master=views["rem"][a:z], m=views["m"][a:z], v=views["v"][a:z], out=out, **kw), None


StateUpdate = MasterInState | SplitMaster


def for_format(fmt: StateFormat, compute: torch.dtype) -> StateUpdate:
    """The update rule of optimizer-state format ``fmt`` beside ``compute``-dtype weights."""
    return SplitMaster(compute) if fmt.split else MasterInState(compute)
