"""One training step over streamed blocks, read top to bottom: forward, turnaround, backward, finish.

The rules it follows (load order, which gradients park, where) are ``fuyou.schedule.rules``; what it
needs from its engine is a ``StepContext``; what it returns is a ``StepResult``.

Load order: forward 0…H−1, the head H (plus the embedding again if tied), then backward H−1…0 — but
the embedding, whose backward reads no weights (``rules.reads_weights_in_backward``).
All K micro-batches pass a block while its weights are resident (layer-grouped accumulation);
gradients accumulate on the device into one flat buffer per block, which is handed to the run's
update policy once complete (``fuyou.engine.updates``: update in backward, clipping with updates
overlapping the next forward, or LoRA adapters — chosen at assembly; the step never asks which).

The ranks' collectives (``StepContext.comm``; ``OneRank`` for one process) reduce-scatter each
block's gradient before it is handed off (the policy sees this rank's shard) and sum the loss and
squared norm read back. A mixture of experts' balance loss (``StepState.balance``:
``fuyou.engine.balance``) counts the routers' choices in forward, fixes its gradient seeds at the
turnaround and adds them to each router's backward.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from fuyou.device.base import Backend
from fuyou.engine import activations, turnaround
from fuyou.engine.balance import StepBalance
from fuyou.engine.updates import UpdatePolicy
from fuyou.models.adapters import Adapter
from fuyou.models.store_layout import ModelLayout
from fuyou.schedule import rules
from fuyou.schedule.plan import RECOMPUTES, Plan
from fuyou.timeline import Timeline
from fuyou.transfer.activation_files import ActivationSpace
from fuyou.transfer.collectives import Collectives
from fuyou.transfer.grad_park import Parked
from fuyou.transfer.weights import WeightLoader


@dataclass(frozen=True)
class StepContext:
    """Everything a step uses from its engine: the layout and plan it follows, the model adapter, the
    backend, what moves data (weights in, activations out and back, collectives between ranks) and the
    update policy that takes the gradients."""

    layout: ModelLayout
    plan: Plan
    adapter: Adapter
    backend: Backend
    loader: WeightLoader
    act_space: ActivationSpace
    timeline: Timeline
    compute_stream: Any
    """The stream forward and backward run on (torch's current stream)."""
    comm: Collectives
    """The ranks' collectives (``OneRank`` for one process). Each rank updates its shard of every
    block: gradients are reduce-scattered before they leave the device, the loss and norm summed."""
    updates: UpdatePolicy
    """What happens to completed gradients (``fuyou.engine.updates``), chosen at assembly."""


class StepIO:
    """A step's bytes — SSD read and written, this rank's collectives — counted by the step they serve
    (``fuyou.timeline``): its own transfers and those of its update, which may run after the step
    returns (the clipping schedule's overlaps the next step). Reading them waits until every transfer
    serving the step has been issued: at once after the next step or a flush, so read them then to
    keep the update overlapping (``Engine.step_io``)."""

    def __init__(self, key: int, settle: Callable[[int], dict[str, int]]) -> None:
        self.key, self._settle = key, settle
        self._got: dict[str, int] | None = None

    def get(self) -> dict[str, int]:
        """Bytes per resource of ``fuyou.timeline.MOVED`` (waits for them to be final, once)."""
        if self._got is None:
            self._got = self._settle(self.key)
        return self._got


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
    io: StepIO = field(repr=False)
    """The step's bytes (``ssd_read_bytes``, ``ssd_write_bytes``, ``comm_bytes``), final once its update
    has issued them."""
    moe_balance_loss: float | None = None
    """A mixture of experts' balance loss (unweighted, as ``transformers`` reports ``aux_loss``);
    ``loss`` includes it times ``router_aux_loss_coef``. None: no balance loss."""

    @property
    def ssd_read_bytes(self) -> int:
        """SSD bytes the step and its update read (waits for the update to have issued them: ``StepIO``)."""
        return self.io.get()["ssd_read"]

    @property
    def ssd_write_bytes(self) -> int:
        """SSD bytes the step and its update wrote (waits as ``ssd_read_bytes``)."""
        return self.io.get()["ssd_write"]

    @property
    def comm_bytes(self) -> int:
        """Bytes this rank's collectives moved (weights gathered in, gradients scattered out; 0 on one rank)."""
        return self.io.get()["comm"]

    def __getitem__(self, key: str) -> Any:
        """Dict-style access (``result["loss"]``), as earlier versions returned a dict."""
        return getattr(self, key)

    def to_json(self, io: bool = True) -> dict:
        """Plain data; with ``io`` the bytes too (waiting as ``ssd_read_bytes``: right after the step, that
        ends the overlap of its update with the next step)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "io"}
        return out | ({k: getattr(self, k) for k in ("ssd_read_bytes", "ssd_write_bytes", "comm_bytes")} if io else {})


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
    once: ``read_back``)."""
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

    def read_back(self, comm: Collectives) -> None:
        """The step's one device→host read: its loss, squared gradient norm and balance loss, summed
        over ranks, once every gradient's norm has been added (block 0's hand-off, or the step's end).
        Idempotent."""
        if not self.read:
            self.loss, self.norm_sq, self.aux = comm.sum_scalars(self.loss_sum, self.sq_sum, self.aux_sum)
            self.read = True

    @property
    def finite(self) -> bool:
        """Whether every gradient of the step was finite (after ``read_back``)."""
        return math.isfinite(self.norm_sq)


class StepRunner:
    """Executes steps over a ``StepContext``; owns the updates still pending between steps."""

    def __init__(self, ctx: StepContext) -> None:
        self.c = ctx
        self.head = turnaround.for_adapter(ctx.adapter)
        """The turnaround: the head whole, or split by vocabulary rows (chosen once, with the model)."""
        lay = ctx.layout
        self._gradients = frozenset(b for b in range(len(lay.blocks)) if lay.gets_gradients(b))
        """The blocks whose gradients backward computes (``ModelLayout.gets_gradients``), fixed with the layout."""
        kinds = [rules.block_kind(blk.name, b, self.head.first) for b, blk in enumerate(lay.blocks)]
        self.weightless = rules.weightless_backward(kinds, ctx.plan)
        """The blocks whose backward loads no weights (``rules.weightless_backward``): their storage, freed
        after forward, stays freed; autograd reads none of it."""

    def gets_gradients(self, b: int) -> bool:
        """Whether backward computes block ``b``'s gradients and hands them off (``ModelLayout.gets_gradients``)."""
        return b in self._gradients

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
        c.updates.begin()
        n = len(c.layout.blocks)
        c.loader.start(rules.load_order(n, self.borrowed(), n - self.head.first, self.weightless))
        try:
            self.forward(st)
            self.turnaround(st)
            self.backward(st)
            applied = c.updates.finish(st)
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
            if b not in self.weightless:
                st.weights[b] = self.load(st, b, refill=policy not in RECOMPUTES)
            if policy in RECOMPUTES:
                st.params[b] = self.bind(st, b)
            if self.gets_gradients(b):
                self.attach_grads(st, b)
            name = c.layout.blocks[b].name
            with self.computing(f"bwd {name}", f"backward of {name}"):
                st.xs = self._backward_block(st, b)
            self.drop_params(st, b)
            st.weights.pop(b, None)
            if self.gets_gradients(b):
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
    def hand_off(self, st: StepState, b: int) -> None:
        """Block ``b``'s gradient is complete: this rank's shard of its sum over ranks (its squared norm
        added to the step's on the device) goes to the update policy."""
        c = self.c
        grad, after, st.sq_sum = c.comm.scatter_gradient(st.grads.pop(b), st.sq_sum, c.layout.blocks[b].name)
        c.updates.hand_off(st, b, grad, after)
