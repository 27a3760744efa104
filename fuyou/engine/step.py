"""One training step over streamed blocks, read top to bottom: forward, turnaround, backward, finish.

The rules it follows (load order, which gradients park, where) are ``fuyou.schedule.rules``; what it
needs from its engine is a ``StepContext``; what it returns is a ``StepResult``.

Load order: forward 0…H−1, the head H (plus the embedding again if tied), then backward H−1…0.
All K micro-batches pass a block while its weights are resident (layer-grouped accumulation);
gradients accumulate on the device into one flat buffer per block, which is handed to the Adam stage
once complete:

* ``overlap_backward`` — Adam(b) starts as soon as block b's backward ends, overlapping backward of
  b−1. A non-finite gradient stops further updates and rolls the step back (``store.abort``). RAM-tier
  writes cannot be rolled back, so RAM-tier blocks 1…R−1 park their gradients until block 0's
  backward proves the whole step finite (``fuyou.schedule.rules.held_back``), then update.
* ``overlap_next_forward`` — gradients are parked (in host memory, or on SSD for blocks from
  ``Plan.park_ram_blocks`` on: ``grad_park``) and the global norm accumulates; after backward the
  clipping coefficient is exact, and Adam(0…H) is submitted in forward order to overlap the *next*
  step — its forward, whose reads of block b wait for Adam(b)'s write, and its turnaround and
  backward, which its writes trail into. That step waits for them (``settle``: commit) only at its
  own end, before submitting its own updates.

With data-parallel ranks (``StepContext.comm``) the loader hands each block over gathered from the
ranks' shards, ``hand_off`` reduce-scatters the block's gradient first (the Adam stage and the
parking see this rank's shard), and the loss and squared norm read back are sums over ranks; a late
non-finite finding of any rank's Adam stage rolls the step back on all.

A mixture of experts' balance loss (``StepState.balance``: ``fuyou.engine.balance``) counts the
routers' choices in forward, fixes its gradient seeds at the turnaround and adds them to each
router's backward. With LoRA (``StepContext.lora``: ``fuyou.engine.lora``) the base is frozen: no
block gets gradients, hands anything off or is updated; ``finish`` clips and steps the adapters.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fuyou.device.base import Backend
from fuyou.engine import activations, turnaround
from fuyou.engine.adam_stage import AdamStage
from fuyou.engine.balance import StepBalance
from fuyou.engine.lora import LoraState
from fuyou.models.adapters import Adapter
from fuyou.models.store_layout import ModelLayout
from fuyou.optim.norm import read_scalars, sum_squares_lazy
from fuyou.schedule import rules
from fuyou.schedule.plan import RECOMPUTES, Plan
from fuyou.timeline import Timeline
from fuyou.transfer.activation_files import ActivationSpace
from fuyou.transfer.collectives import Collectives
from fuyou.transfer.futures import done_future
from fuyou.transfer.grad_park import GradientParking, Parked
from fuyou.transfer.ram_tier import RamTier
from fuyou.transfer.weights import WeightLoader


@dataclass
class Progress:
    """The run's optimizer progress, shared by the engine and its step runner."""

    step: int = 0
    """Updates applied so far (the next update is ``step + 1``)."""
    lr: float = 1e-5
    """Learning rate of the next update(s)."""


@dataclass(frozen=True)
class StepContext:
    """Everything a step uses from its engine: the layout and plan it follows, the model adapter, the
    backend, and the stages that move data (weights in, gradients out, optimizer state through Adam)."""

    layout: ModelLayout
    plan: Plan
    adapter: Adapter
    backend: Backend
    loader: WeightLoader
    stage: AdamStage
    parking: GradientParking
    tier: RamTier
    act_space: ActivationSpace
    timeline: Timeline
    compute_stream: Any
    """The stream forward and backward run on (torch's current stream)."""
    max_grad_norm: float
    """Global-norm clipping threshold (0: off)."""
    progress: Progress
    commit_meta: Callable[[], dict]
    """What each committed store version records (reads ``progress``)."""
    comm: Collectives | None = None
    """The data-parallel ranks' collectives (None: one rank). Each rank updates its shard of every
    block: gradients are reduce-scattered before they leave the device, the loss and norm summed."""
    lora: LoraState | None = None
    """LoRA adapters trained on a frozen base (None: full fine-tuning). The blocks then get no
    gradients and no updates; the adapters are clipped and stepped after backward (``finish``)."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did. Times in seconds, sizes in bytes. ``result["loss"]`` works too."""

    step: int
    """Updates applied after this step."""
    loss: float
    """Mean loss over the step's labelled tokens."""
    grad_norm: float
    """Global L2 norm of the gradient, before clipping."""
    applied: bool
    """False: a non-finite gradient, the update was skipped."""
    lr: float
    tokens: int
    step_time_s: float
    tokens_per_s: float
    wall_s: float
    busy_s: dict[str, float]
    """Busy seconds per resource (``fuyou.timeline.RESOURCES``) within the step."""
    busy_frac: dict[str, float]
    bottleneck: str
    """The busiest resource."""
    ssd_read_bytes: int
    ssd_write_bytes: int
    comm_bytes: int = 0
    """Bytes this rank's collectives moved (weights gathered in, gradients scattered out; 0 on one rank)."""
    moe_balance_loss: float | None = None
    """A mixture of experts' balance loss (unweighted, as ``transformers`` reports ``aux_loss``);
    ``loss`` includes it times ``router_aux_loss_coef``. None: no balance loss."""

    def __getitem__(self, key: str) -> Any:
        """Dict-style access (``result["loss"]``), as earlier versions returned a dict."""
        return getattr(self, key)

    def to_json(self) -> dict:
        """Plain data."""
        return asdict(self)


@dataclass
class StepState:
    """Everything one step keeps between its phases."""

    xs: list
    ctxs: list
    labels: list[torch.Tensor]
    num_items: int
    saved: dict[int, list] = field(default_factory=dict)
    weights: dict[int, torch.Tensor] = field(default_factory=dict)
    params: dict[int, dict[str, torch.nn.Parameter]] = field(default_factory=dict)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    loss_sum: float | torch.Tensor = 0.0
    """Σ of the micro-batches' losses, plus the balance loss term, where they were computed (read back
    once: ``StepRunner.read_back``)."""
    sq_sum: float | torch.Tensor = 0.0
    """Σ of the blocks' squared gradient norms, where the gradients are (read back once)."""
    loss: float = math.nan
    norm_sq: float = math.nan
    read: bool = False
    """Whether ``loss`` and ``norm_sq`` hold the read-back values."""
    written: dict[int, Future] = field(default_factory=dict)
    parked: dict[int, Parked] = field(default_factory=dict)
    balance: StepBalance | None = None
    """A mixture of experts' router statistics and balance-loss seeds (None: no balance loss)."""
    aux_sum: float | torch.Tensor = 0.0
    """The balance loss (this rank's share, read back with the loss)."""
    aux: float = math.nan
    """The balance loss read back (``read_back``)."""


class StepRunner:
    """Executes steps over a ``StepContext``; owns the updates still pending between steps."""

    def __init__(self, ctx: StepContext) -> None:
        self.c = ctx
        self.pending: dict[int, Future] = {}
        """overlap_next_forward: block → the future of its update submitted after the last backward."""
        lay = ctx.layout
        self._training = frozenset(
            b
            for b, blk in enumerate(lay.blocks)
            if ctx.lora is None and any(lay.trains(o) for o in [b] + [lay.index(n) for n in blk.borrows])
        )
        """The blocks that train (``trains``), fixed with the layout: computed once, not per hand-off."""
        self.head = turnaround.for_adapter(ctx.adapter)
        """The turnaround: the head whole, or split by vocabulary rows (chosen once, with the model)."""

    def trains(self, b: int) -> bool:
        """Whether block ``b`` gets gradients, hands them off and is updated: not with LoRA (its base is
        frozen), nor a block frozen whole (``--freeze``) unless the head uses a block that trains."""
        return b in self._training

    def last_gradient(self) -> int:
        """The block whose gradient completes the step (backward's last that trains; -1: none)."""
        return min(self._training, default=-1)

    def borrowed(self) -> list[int]:
        """The blocks the head borrows (a tied embedding)."""
        lay = self.c.layout
        return [lay.index(o) for o in lay.blocks[-1].borrows]

    def run(self, st: StepState) -> tuple[bool, float, float]:
        """One step over ``st``'s micro-batches: forward, turnaround, backward, finish (which first
        settles the last step's updates, clipping schedule). Returns (applied, t0, t1): whether an
        update was applied and the step's start and end (``time.perf_counter``)."""
        c = self.c
        t0 = time.perf_counter()
        if c.lora is not None:
            c.lora.zero_grad()
        c.loader.gate = self.gate
        n = len(c.layout.blocks)
        c.loader.start(rules.load_order(n, self.borrowed(), n - self.head.first))
        try:
            self.forward(st)
            self.turnaround(st)
            self.backward(st)
            applied = self.finish(st)
        finally:
            c.loader.drain()
        return applied, t0, time.perf_counter()

    # ---------------------------------------------------------------- helpers
    def bind(
        self, st: StepState, b: int, borrowed: dict[int, torch.Tensor] | None = None
    ) -> dict[str, torch.nn.Parameter]:
        c = self.c
        dt = c.layout.compute_dtype
        tensors = c.layout.unflatten(b, st.weights[b].view(dt))
        for o, w in (borrowed or {}).items():
            tensors.update(c.layout.unflatten(o, w.view(dt)))
        return c.adapter.bind(b, tensors)

    def attach_grads(self, st: StepState, b: int) -> None:
        """Point every parameter's ``.grad`` at its owner block's flat device gradient buffer."""
        c = self.c
        owners = [o for o in [b] + [c.layout.index(o) for o in c.layout.blocks[b].borrows] if c.layout.trains(o)]
        for o in owners:
            if o not in st.grads:
                st.grads[o] = c.backend.device_empty(
                    (c.layout.full_numel(o),), c.layout.compute_dtype, f"gradients of {c.layout.blocks[o].name}"
                ).zero_()
        views = {}
        for o in owners:
            views.update(c.layout.unflatten(o, st.grads[o]))
        for key, p in st.params[b].items():
            if p.requires_grad:  # a frozen parameter's slice stays zero
                p.grad = views[key]

    def load(self, st: StepState, b: int, refill: bool = False) -> torch.Tensor:
        c = self.c
        w = c.loader.next(b, into=st.weights.get(b) if refill else None)
        c.loader.ready_event().wait(c.compute_stream)  # compute must not read weights before the copy lands
        return w

    def computing(self, label: str, what: str) -> contextlib.ExitStack:
        """Context around compute: a device span ``label`` on the compute stream's timeline, and every
        allocation inside counted against the device budget as ``what`` (``Backend.counting``)."""
        c = self.c
        stack = contextlib.ExitStack()
        stack.enter_context(c.timeline.device_span("compute", label, c.backend, c.compute_stream))
        stack.enter_context(c.backend.counting(what))
        return stack

    def drop_params(self, st: StepState, b: int) -> None:
        """After backward: detach gradients from the parameters and unbind the block's modules."""
        for p in st.params.pop(b).values():
            p.grad = None
        self.c.adapter.unbind(b)

    def _release_weights(self, st: StepState, b: int, keep_views: bool) -> None:
        w = st.weights.pop(b)
        if keep_views:  # the graph holds views of w: free the memory, keep the objects
            self.c.backend.free_storage(w)
            st.weights[b] = w

    # ---------------------------------------------------------------- phases
    def forward(self, st: StepState) -> None:
        c = self.c
        H = len(c.layout.blocks) - 1
        for b in range(self.head.first):
            policy = c.plan.policy(b, H + 1)
            st.weights[b] = self.load(st, b)
            st.params[b] = self.bind(st, b)
            name = c.layout.blocks[b].name
            with self.computing(f"fwd {name}", f"forward of {name}"):
                out = [
                    activations.forward(
                        c.adapter,
                        b,
                        st.xs[k],
                        st.ctxs[k],
                        policy,
                        c.backend,
                        [st.weights[b]],
                        c.act_space,
                        k,
                        st.balance,
                    )  # fmt: skip
                    for k in range(len(st.xs))
                ]
            st.xs = [o[0] for o in out]
            st.ctxs = [o[1] for o in out]
            st.saved[b] = [o[2] for o in out]
            if policy in RECOMPUTES:
                del st.params[b]
            c.adapter.unbind(b)
            self._release_weights(st, b, keep_views=policy not in RECOMPUTES)

    def turnaround(self, st: StepState) -> None:
        """Head forward, loss, head backward (``fuyou.engine.turnaround``: the head whole, or split by
        vocabulary rows), after the balance loss's seeds are fixed."""
        if st.balance is not None:  # every router has run: the balance loss's counts are complete
            weighted, st.aux_sum = st.balance.turnaround()
            st.loss_sum = st.loss_sum + weighted
        self.head.run(self, st)

    def backward(self, st: StepState) -> None:
        c = self.c
        H = len(c.layout.blocks) - 1
        for b in range(self.head.first - 1, -1, -1):
            policy = c.plan.policy(b, H + 1)
            for a in (b, b - 1):  # SSD-swapped activations: this block's and, ahead, the next one's
                activations.prefetch(st.saved.get(a, []))
            st.weights[b] = self.load(st, b, refill=policy not in RECOMPUTES)
            if policy in RECOMPUTES:
                st.params[b] = self.bind(st, b)
            if self.trains(b):
                self.attach_grads(st, b)
            name = c.layout.blocks[b].name
            with self.computing(f"bwd {name}", f"backward of {name}"):
                st.xs = self._backward_block(st, b)
            self.drop_params(st, b)
            st.weights.pop(b)
            if self.trains(b):
                self.hand_off(st, b)

    def _backward_block(self, st: StepState, b: int) -> list[torch.Tensor | None]:
        """Backward of block ``b`` over the micro-batches; returns the gradients of its inputs. What it
        saved goes with this call: the graphs' leaves are the block's parameters, so a graph still
        referenced would keep the block's weights on the device through the next block's backward."""
        saved, ahead = st.saved.pop(b), st.saved.get(b - 1, [None])[0]
        xs = []
        for k, (s, dy) in enumerate(zip(saved, st.xs)):
            activations.upload(saved[k + 1] if k + 1 < len(saved) else ahead)  # host-swapped: one ahead
            xs.append(activations.backward(self.c.adapter, b, s, dy, self.c.backend, k, st.balance))
        return xs

    # ---------------------------------------------------------------- optimizer hand-off
    def _update(self, b: int, grad: Any, ready: Any, scale: float, hold: bool = False) -> Future:
        p = self.c.progress
        return self.c.stage.update(b, grad, ready, p.lr, p.step + 1, scale, hold)

    def read_back(self, st: StepState) -> None:
        """The step's one device→host read: its loss and squared gradient norm, once backward has
        handed off every block (block 0 last)."""
        if not st.read:
            read = self.c.comm.sum_scalars if self.c.comm is not None else read_scalars
            st.loss, st.norm_sq, st.aux = read(st.loss_sum, st.sq_sum, st.aux_sum)
            st.read = True

    @staticmethod
    def finite(st: StepState) -> bool:
        """Whether every gradient of the step was finite (after ``read_back``)."""
        return math.isfinite(st.norm_sq)

    def hand_off(self, st: StepState, b: int) -> None:
        """Block ``b``'s gradient is complete: its squared norm joins the step's sum on the device, and
        it goes to the Adam stage, or is parked (``rules.parked``). ``overlap_backward`` updates SSD-tier
        blocks without waiting to know the step finite (a non-finite step is rolled back by
        ``store.abort``); block 0, the last gradient, reads the step's norm back first, and only a
        finite step updates it and the held-back RAM-tier blocks, whose writes cannot be rolled back."""
        c = self.c
        grad, after = st.grads.pop(b), None
        if c.comm is not None:  # this rank's shard of the gradient summed over ranks
            grad, after, st.sq_sum = c.comm.scatter_gradient(grad, st.sq_sum, c.layout.blocks[b].name)
        else:
            st.sq_sum = st.sq_sum + sum_squares_lazy(grad)
        if c.plan.clips or b in rules.held_back(c.plan):
            st.parked[b] = c.parking.park(b, grad, after)
            return
        if b == self.last_gradient():
            self.read_back(st)
            if not self.finite(st):
                return
            for o in sorted(st.parked, reverse=True):  # RAM-tier blocks held back may update now
                st.written[o] = self._update(o, *c.parking.source(st.parked.pop(o)), 1.0)
        buf, ready = c.stage.offload(b, grad, after=after)
        st.written[b] = self._update(b, buf, ready, 1.0)

    def finish(self, st: StepState) -> bool:
        """After backward: commit (overlap_backward) or submit clipped updates (next_forward).

        Returns whether an update was applied (False: non-finite gradient, step skipped).
        """
        c = self.c
        if c.lora is not None:
            return self._finish_lora(st)
        self.read_back(st)
        if not c.plan.clips:
            wait(list(st.written.values()))
            for p in st.parked.values():  # held-back RAM-tier gradients of a non-finite step
                c.parking.discard(p)
            st.parked.clear()
            late = self.late_nonfinite()  # the Adam stage's own check of what it received
            if not self.finite(st) or late:
                c.stage.worker.wait()
                c.tier.abort()
                return False
            for f in st.written.values():
                f.result()
            c.progress.step += 1
            c.tier.commit(c.commit_meta())
            return True
        if not self.settle() or not self.finite(st):  # a rolled-back last step voids this one's gradients
            for p in st.parked.values():
                c.parking.discard(p)
            st.parked.clear()
            return False
        norm = math.sqrt(st.norm_sq)
        scale = min(1.0, c.max_grad_norm / (norm + 1e-6)) if c.max_grad_norm else 1.0
        for b in sorted(st.parked):
            self.pending[b] = self._update(b, *c.parking.source(st.parked.pop(b)), scale, hold=True)
        c.progress.step += 1
        return True

    def _finish_lora(self, st: StepState) -> bool:
        """LoRA: the adapters' gradients are the step's (summed over ranks); clip them by their global
        norm and step their AdamW (a non-finite norm skips the step on every rank). The frozen base is
        not written."""
        c = self.c
        if c.lora is not None and c.comm is not None:  # every rank's adapter gradients summed, on every rank
            flat = c.lora.flat_grads()
            c.comm.sum_on_device(flat, "lora gradients")
            per = -(-flat.numel() // c.comm.world)  # each rank counts its share of the summed norm
            st.sq_sum = sum_squares_lazy(flat[c.comm.rank * per : (c.comm.rank + 1) * per])
        else:
            st.sq_sum = c.lora.sq_norm() if c.lora is not None else 0.0
        self.read_back(st)
        if not self.finite(st) or c.lora is None:
            return False
        norm = math.sqrt(st.norm_sq)
        scale = min(1.0, c.max_grad_norm / (norm + 1e-6)) if c.max_grad_norm else 1.0
        with c.backend.counting("the LoRA adapters' AdamW step"):
            c.lora.step(c.progress.lr, scale)
        c.progress.step += 1
        return True

    def settle(self) -> bool:
        """overlap_next_forward: wait for the previous step's updates and commit them. Returns False
        when they came out non-finite and were rolled back (a step computed since read their weights
        and must be dropped), else True."""
        self.c.stage.new_weights.drop()  # no forward claims them any more: nothing may wait for one
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

    def late_nonfinite(self) -> set[int]:
        """Blocks whose update came out non-finite though the step was found finite (the Adam stage's
        check); with several ranks, any rank's finding rolls the step back on all (-1 stands for
        another rank's blocks)."""
        late = self.c.stage.take_nonfinite()
        if self.c.comm is not None and self.c.comm.any(bool(late)) and not late:
            return {-1}
        return late

    def gate(self, b: int) -> Future:
        """Loader gate: block b's weights may be read once the pending update of b has written them
        (every read of b until ``settle``: forward, the head's borrowed blocks, backward)."""
        return self.pending.get(b, done_future())
