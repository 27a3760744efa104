"""Update policies: how a step's gradients become optimizer updates, one class per policy, chosen once.

The step (``fuyou.engine.step.StepRunner``) calls the same four methods whatever the policy is:
``begin`` before forward, ``hand_off`` when backward completes a block's gradient (already summed
over ranks, its squared norm added to the step's), ``finish`` after backward, ``settle`` before
anything reads the store as a whole (the next step's end, a flush, an evaluation); and the weight
loader asks ``gate`` before reading a block's weights. ``for_run`` picks the policy at assembly:

* ``UpdateInBackward`` (schedule ``overlap_backward``, no clipping) — Adam(b) starts as soon as block
  b's backward ends, overlapping backward of b−1. A non-finite gradient stops further updates and
  rolls the step back (``store.abort``). RAM-tier writes cannot be rolled back, so RAM-tier blocks
  1…R−1 park their gradients until block 0's backward proves the whole step finite
  (``fuyou.schedule.rules.held_back``), then update.
* ``ClipOverlapNextForward`` (schedule ``overlap_next_forward``: clipping) — every gradient is parked
  (host memory, or SSD from ``Plan.park_ram_blocks`` on: ``grad_park``) while the global norm
  accumulates; after backward the clipping coefficient is exact and Adam(0…H) is submitted in
  forward order to overlap the *next* step, whose reads of block b wait for Adam(b)'s write
  (``gate``). That step waits for them (``settle``: commit) only at its own end, before submitting
  its own updates.
* ``LoraAdapters`` — the base is frozen: no block gets gradients or is updated; ``finish`` sums the
  adapters' gradients over ranks, clips them by their global norm and steps their AdamW on the device.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fuyou.device.base import Backend
from fuyou.engine.adam_stage import AdamStage
from fuyou.engine.lora import LoraState, NoAdapters
from fuyou.optim.norm import sum_squares_lazy
from fuyou.schedule import rules
from fuyou.schedule.plan import Plan
from fuyou.transfer.collectives import Collectives
from fuyou.transfer.futures import done_future
from fuyou.transfer.grad_park import GradientParking
from fuyou.transfer.ram_tier import RamTier

if TYPE_CHECKING:
    from fuyou.engine.step import StepState


@dataclass
class Progress:
    """The run's optimizer progress, shared by the engine, its step runner and the update policy."""

    step: int = 0
    """Updates applied so far (the next update is ``step + 1``)."""
    lr: float = 1e-5
    """Learning rate of the next update(s)."""


@dataclass(frozen=True)
class UpdateContext:
    """What an update policy uses from its engine: the plan, where gradients go (the Adam stage, the
    parking), what commits (the store behind the RAM tier), the ranks, and the run's progress."""

    plan: Plan
    backend: Backend
    stage: AdamStage
    parking: GradientParking
    tier: RamTier
    comm: Collectives
    """The ranks' collectives (``OneRank`` for one process)."""
    progress: Progress
    commit_meta: Callable[[], dict]
    """What each committed store version records (reads ``progress``)."""
    max_grad_norm: float
    """Global-norm clipping threshold (0: off)."""


def clip_scale(norm_sq: float, max_norm: float) -> float:
    """The clipping coefficient of a global gradient norm √``norm_sq`` (1 without clipping: ``max_norm`` 0)."""
    return min(1.0, max_norm / (math.sqrt(norm_sq) + 1e-6)) if max_norm else 1.0


class UpdatePolicy:
    """The interface the step calls; see the module docstring. Subclasses own what is pending."""

    def __init__(self, ctx: UpdateContext) -> None:
        self.c = ctx

    def begin(self) -> None:
        """Before a step's forward."""

    def gate(self, b: int) -> Future:
        """A future the loader waits for before reading block ``b``'s weights (done: read at once)."""
        return done_future()

    def hand_off(self, st: StepState, b: int, grad: Any, after: Any) -> None:
        """Block ``b``'s gradient ``grad`` is complete (this rank's shard; ``after``: the event its
        reduce-scatter ends with, None on one rank)."""
        raise NotImplementedError(f"{type(self).__name__} updates no blocks")

    def finish(self, st: StepState) -> bool:
        """After backward: apply or submit the step's updates. Returns whether an update was applied
        (False: a non-finite gradient, the step skipped)."""
        raise NotImplementedError

    def settle(self) -> bool:
        """Wait for the updates still pending and commit them. Returns False when they came out
        non-finite and were rolled back (a step computed since read their weights and must be
        dropped), else True."""
        self.c.stage.new_weights.drop()  # no forward claims them any more: nothing may wait for one
        return True

    # ---------------------------------------------------------------- shared by the policies
    def _update(self, b: int, grad: Any, ready: Any, scale: float, hold: bool = False) -> Future:
        p = self.c.progress
        return self.c.stage.update(b, grad, ready, p.lr, p.step + 1, scale, hold)

    def _discard_parked(self, st: StepState) -> None:
        for p in st.parked.values():
            self.c.parking.discard(p)
        st.parked.clear()

    def late_nonfinite(self) -> set[int]:
        """Blocks whose update came out non-finite though the step was found finite (the Adam stage's
        check); with several ranks, any rank's finding rolls the step back on all (-1 stands for
        another rank's blocks)."""
        late = self.c.stage.take_nonfinite()
        if self.c.comm.any(bool(late)) and not late:
            return {-1}
        return late


class UpdateInBackward(UpdatePolicy):
    """``overlap_backward``: each block updated as its gradient completes; see the module docstring."""

    def __init__(self, ctx: UpdateContext, last_gradient: int) -> None:
        super().__init__(ctx)
        self.last = last_gradient
        """The block whose gradient completes the step (backward's last that trains)."""
        self.held = rules.held_back(ctx.plan)

    def hand_off(self, st: StepState, b: int, grad: Any, after: Any) -> None:
        """Update ``b`` at once, unless it is a held-back RAM-tier block (parked); the last gradient reads
        the step's norm back first, and only a finite step updates it and the held-back blocks."""
        c = self.c
        if b in self.held:
            st.parked[b] = c.parking.park(b, grad, after)
            return
        if b == self.last:
            st.read_back(c.comm)
            if not st.finite:
                return
            for o in sorted(st.parked, reverse=True):  # RAM-tier blocks held back may update now
                st.written[o] = self._update(o, *c.parking.source(st.parked.pop(o)), 1.0)
        buf, ready = c.stage.offload(b, grad, after=after)
        st.written[b] = self._update(b, buf, ready, 1.0)

    def finish(self, st: StepState) -> bool:
        """Wait for the step's updates, then commit (finite) or roll back (non-finite here, or found so by
        the Adam stage)."""
        c = self.c
        st.read_back(c.comm)
        wait(list(st.written.values()))
        self._discard_parked(st)  # held-back RAM-tier gradients of a non-finite step
        late = self.late_nonfinite()  # the Adam stage's own check of what it received
        if not st.finite or late:
            c.stage.worker.wait()
            c.tier.abort()
            return False
        for f in st.written.values():
            f.result()
        c.progress.step += 1
        c.tier.commit(c.commit_meta())
        return True


class ClipOverlapNextForward(UpdatePolicy):
    """``overlap_next_forward``: clipped updates submitted after backward, overlapping the next step."""

    def __init__(self, ctx: UpdateContext) -> None:
        super().__init__(ctx)
        self.pending: dict[int, Future] = {}
        """Block → the future of its update submitted after the last backward."""

    def gate(self, b: int) -> Future:
        """Block b's weights may be read once the pending update of b has written them (every read of b
        until ``settle``: forward, the head's borrowed blocks, backward)."""
        return self.pending.get(b, done_future())

    def hand_off(self, st: StepState, b: int, grad: Any, after: Any) -> None:
        """Park the gradient until the step's norm is known."""
        st.parked[b] = self.c.parking.park(b, grad, after)

    def finish(self, st: StepState) -> bool:
        """Settle the last step's updates, then submit this step's, clipped by the exact global norm."""
        c = self.c
        st.read_back(c.comm)
        if not self.settle() or not st.finite:  # a rolled-back last step voids this one's gradients
            self._discard_parked(st)
            return False
        scale = clip_scale(st.norm_sq, c.max_grad_norm)
        for b in sorted(st.parked):
            self.pending[b] = self._update(b, *c.parking.source(st.parked.pop(b)), scale, hold=True)
        c.progress.step += 1
        return True

    def settle(self) -> bool:
        super().settle()
        if not self.pending:
            return True
        futs = list(self.pending.values())
        self.pending.clear()
        wait(futs)
        for f in futs:
            f.result()
        late = self.late_nonfinite()
        if late:  # the device found the step finite, the Adam stage did not: roll it back
            self.c.tier.abort()
            self.c.progress.step -= 1
            warnings.warn(
                f"step {self.c.progress.step + 1} rolled back: the updates of blocks {sorted(late)} came out "
                "non-finite though the device found the gradients finite (a corrupted copy?)",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        self.c.tier.commit(self.c.commit_meta())
        return True


class LoraAdapters(UpdatePolicy):
    """LoRA: the adapters trained on the device, the frozen base never written."""

    def __init__(self, ctx: UpdateContext, lora: LoraState) -> None:
        super().__init__(ctx)
        self.lora = lora

    def begin(self) -> None:
        self.lora.zero_grad()

    def finish(self, st: StepState) -> bool:
        """The adapters' gradients summed over ranks, clipped by their global norm, stepped (a non-finite
        norm skips the step on every rank)."""
        c = self.c
        flat = self.lora.flat_grads()
        if c.comm.world > 1:  # every rank's adapter gradients summed, on every rank
            c.comm.sum_on_device(flat, "lora gradients")
            per = -(-flat.numel() // c.comm.world)  # each rank counts its share of the summed norm
            st.sq_sum = sum_squares_lazy(flat[c.comm.rank * per : (c.comm.rank + 1) * per])
        else:
            st.sq_sum = self.lora.sq_norm()
        st.read_back(c.comm)
        if not st.finite:
            return False
        with c.backend.counting("the LoRA adapters' AdamW step"):
            self.lora.step(c.progress.lr, clip_scale(st.norm_sq, c.max_grad_norm))
        c.progress.step += 1
        return True


def for_run(ctx: UpdateContext, lora: LoraState | NoAdapters, last_gradient: int) -> UpdatePolicy:
    """The update policy of a run: LoRA adapters (``lora``), clipping (``Plan.clips``), or update in
    backward (``last_gradient``: the block whose gradient completes a step)."""
    if isinstance(lora, LoraState):
        return LoraAdapters(ctx, lora)
    if ctx.plan.clips:
        return ClipOverlapNextForward(ctx)
    return UpdateInBackward(ctx, last_gradient)
