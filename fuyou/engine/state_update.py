"""How the Adam stage updates one state chunk, by optimizer-state format — one class per way the master and
moments are kept (``fuyou.schedule.state_format``), chosen once at assembly (``for_format``):

* ``MasterInState`` — an fp32 master in the chunk (``fp32``, ``fp32-bf16``): the kernel writes the new bf16
  weights as it goes (fp32 weights: a copy of the master after the kernel).
* ``SplitMaster`` — the master is the block's compute weights plus the chunk's remainders (``split``,
  ``bf16``): the stage reads the old weights into the new-weights buffer first (``reads_weights``) and the
  kernel rewrites them in place (``adamw_split_step``); beside fp32 weights the weights *are* the master.
* ``Int8Moments`` — ``SplitMaster`` with 8-bit block-wise moments (``int8``, ``fuyou.optim.quant8``): one
  job per chunk, since a quantization block's scale covers elements of several weight-decay runs.

Each turns a chunk's runs of equal weight decay into the Adam worker's jobs (``jobs``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fuyou.optim import AdamJob, adamw_int8_step, adamw_split_step, adamw_step
from fuyou.schedule.state_format import StateFormat

OnDone = Callable[[AdamJob], None] | None
Runs = list[tuple[int, int, bool]]
"""Element ranges [a, z) of a chunk (relative to its start) with whether weight decay applies."""


@dataclass(frozen=True)
class _PerRun:
    """A rule whose jobs are one per run of equal weight decay (``job``)."""

    compute: torch.dtype

    def job(
        self, views: dict[str, torch.Tensor], a: int, z: int, out: torch.Tensor, **kw: Any
    ) -> tuple[AdamJob, OnDone]:
        raise NotImplementedError

    def jobs(
        self, views: dict[str, torch.Tensor], runs: Runs, out: torch.Tensor, grad: torch.Tensor, key: str, **kw: Any
    ) -> list[tuple[AdamJob, OnDone]]:
        """The worker's jobs for a chunk's ``views``: ``out`` and ``grad`` are the chunk's elements of the
        new-weights buffer and of the gradient; ``kw``: the jobs' other fields (lr, step, grad_scale)."""
        return [
            self.job(
                views, a, z, out[a:z], key=f"{key}[{a}:{z}]", grad=grad[a:z], weight_decay=None if d else 0.0, **kw
            )
            for a, z, d in runs
        ]


@dataclass(frozen=True)
class MasterInState(_PerRun):
    """An fp32 master vector of its own in every state chunk."""

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
class SplitMaster(_PerRun):
    """The master as the compute weights plus a remainder (``fuyou.optim.split``)."""

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


@dataclass(frozen=True)
class Int8Moments:
    """A split master with 8-bit block-wise m and v (``fuyou.optim.quant8``)."""

    compute: torch.dtype
    reads_weights = True

    def step(self, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, **kw: Any) -> bool:
        """``adamw_int8_step``: dequantize, AdamW on the split master (beside fp32 weights: on the weights
        themselves), quantize, per block of the chunk."""
        scales = kw.pop("m_scale"), kw.pop("v_scale")  # the job's ``extra``, beside the runs
        return adamw_int8_step(master, m, v, *scales, grad, **kw)

    def jobs(
        self, views: dict[str, torch.Tensor], runs: Runs, out: torch.Tensor, grad: torch.Tensor, key: str, **kw: Any
    ) -> list[tuple[AdamJob, OnDone]]:
        """One job over the whole chunk (as ``_PerRun.jobs``), its runs passed to the kernel."""
        fp32 = self.compute == torch.float32
        job = AdamJob(
            key=key, master=out if fp32 else views["rem"], m=views["m"], v=views["v"], grad=grad,
            out=None if fp32 else out, extra={"m_scale": views["m_scale"], "v_scale": views["v_scale"], "runs": runs},
            **kw,
        )  # fmt: skip
        return [(job, None)]


StateUpdate = MasterInState | SplitMaster | Int8Moments


def for_format(fmt: StateFormat, compute: torch.dtype) -> StateUpdate:
    """The update rule of optimizer-state format ``fmt`` beside ``compute``-dtype weights."""
    if fmt.quant_block:
        return Int8Moments(compute)
    return SplitMaster(compute) if fmt.split else MasterInState(compute)
