"""One training step over streamed blocks, read top to bottom: forward, turnaround, backward, finish.

Load order: forward 0…H−1, the head H (plus the embedding again if tied), then backward H−1…0.
All K micro-batches pass a block while its weights are resident (layer-grouped accumulation);
gradients accumulate on the device into one flat buffer per block, which is handed to the Adam stage
once complete:

* ``overlap_backward`` — Adam(b) starts as soon as block b's backward ends, overlapping backward of
  b−1. A non-finite gradient stops further updates and rolls the step back (``store.abort``). RAM-tier
  writes cannot be rolled back, so RAM-tier blocks 1…R−1 park their gradients until block 0's
  backward proves the whole step finite (``ram_tier.rollback_blocks``), then update.
* ``overlap_next_forward`` — gradients are parked (in host memory, or on SSD for blocks from
  ``Plan.park_ram_blocks`` on: ``grad_park``) and the global norm accumulates; after backward the
  clipping coefficient is exact, and Adam(0…H) is submitted in forward order to overlap the *next*
  step's forward, whose reads of block b wait for Adam(b)'s write.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from fuyou.engine import activations
from fuyou.engine.futures import done_future
from fuyou.engine.grad_park import Parked, park_class  # noqa: F401 - park_class: the engine's import path
from fuyou.engine.optimizer import AdamStage
from fuyou.optim.norm import sum_squares
from fuyou.engine.ram_tier import rollback_blocks


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
    loss: float = 0.0
    norm_sq: float = 0.0
    finite: bool = True
    written: dict[int, Future] = field(default_factory=dict)
    parked: dict[int, Parked] = field(default_factory=dict)


class StepRunner:
    """Executes steps for an ``Engine`` (which owns the store, loader, stage, adapter, plan)."""

    def __init__(self, engine: "object") -> None:
        self.e = engine

    # ---------------------------------------------------------------- helpers
    def _bind(self, st: StepState, b: int, borrowed: dict[int, torch.Tensor] | None = None) -> dict[str, torch.nn.Parameter]:
        e = self.e
        dt = e.layout.compute_dtype
        tensors = e.layout.unflatten(b, st.weights[b].view(dt))
        for o, w in (borrowed or {}).items():
            tensors.update(e.layout.unflatten(o, w.view(dt)))
        return e.adapter.bind(b, tensors)

    def _attach_grads(self, st: StepState, b: int) -> None:
        """Point every parameter's ``.grad`` at its owner block's flat device gradient buffer."""
        e = self.e
        owners = [b] + [e.layout.index(o) for o in e.layout.blocks[b].borrows]
        for o in owners:
            if o not in st.grads:
                st.grads[o] = e.backend.device_empty((e.layout.numel(o),), e.layout.compute_dtype,
                                                     f"gradients of {e.layout.blocks[o].name}").zero_()
        views = {}
        for o in owners:
            views.update(e.layout.unflatten(o, st.grads[o]))
        for key, p in st.params[b].items():
            p.grad = views[key]

    def _load(self, st: StepState, b: int, refill: bool = False) -> torch.Tensor:
        e = self.e
        w = e.loader.next(b, into=st.weights.get(b) if refill else None)
        e.loader.ready_event().wait(e.compute_stream)  # compute must not read weights before the copy lands
        return w

    def _drop_params(self, st: StepState, b: int) -> None:
        """After backward: detach gradients from the parameters and unbind the block's modules."""
        for p in st.params.pop(b).values():
            p.grad = None
        self.e.adapter.unbind(b)

    def _release_weights(self, st: StepState, b: int, keep_views: bool) -> None:
        w = st.weights.pop(b)
        if keep_views:  # the graph holds views of w: free the memory, keep the objects
            self.e.backend.free_storage(w)
            st.weights[b] = w

    # ---------------------------------------------------------------- phases
    def forward(self, st: StepState) -> None:
        e = self.e
        H = len(e.layout.blocks) - 1
        for b in range(H):
            policy = e.plan.policy(b, H + 1)
            st.weights[b] = self._load(st, b)
            st.params[b] = self._bind(st, b)
            with e.timeline.span("compute", f"fwd {e.layout.blocks[b].name}"):
                out = [activations.forward(e.adapter, b, st.xs[k], st.ctxs[k], policy, e.backend,
                                           [st.weights[b]], e.act_space, k) for k in range(len(st.xs))]
            st.xs = [o[0] for o in out]
            st.ctxs = [o[1] for o in out]
            st.saved[b] = [o[2] for o in out]
            if policy == "recompute":
                del st.params[b]
            e.adapter.unbind(b)
            self._release_weights(st, b, keep_views=policy != "recompute")

    def turnaround(self, st: StepState) -> None:
        """Head forward, loss, head backward — per micro-batch, so logits never pile up."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        e = self.e
        H = len(e.layout.blocks) - 1
        st.weights[H] = self._load(st, H)
        borrowed = {e.layout.index(o): self._load(st, e.layout.index(o)) for o in e.layout.blocks[H].borrows}
        st.params[H] = self._bind(st, H, borrowed)
        self._attach_grads(st, H)
        dys = []
        with e.timeline.span("compute", "head fwd+bwd"):
            for k, x in enumerate(st.xs):
                x_in = x.detach().requires_grad_()
                with torch.enable_grad():
                    logits, _ = e.adapter.forward(H, x_in, st.ctxs[k])
                    loss = ForCausalLMLoss(logits, st.labels[k], e.adapter.config.vocab_size,
                                           num_items_in_batch=st.num_items)
                loss.backward()
                st.loss += loss.item()
                dys.append(x_in.grad)
        st.xs = dys
        self._drop_params(st, H)
        del borrowed
        st.weights.pop(H)
        self.hand_off(st, H)

    def backward(self, st: StepState) -> None:
        e = self.e
        H = len(e.layout.blocks) - 1
        for b in range(H - 1, -1, -1):
            policy = e.plan.policy(b, H + 1)
            for a in (b, b - 1):  # SSD-swapped activations: this block's and, ahead, the next one's
                activations.prefetch(st.saved.get(a, []))
            st.weights[b] = self._load(st, b, refill=policy != "recompute")
            if policy == "recompute":
                st.params[b] = self._bind(st, b)
            self._attach_grads(st, b)
            with e.timeline.span("compute", f"bwd {e.layout.blocks[b].name}"):
                st.xs = [activations.backward(e.adapter, b, s, dy, e.backend) for s, dy in zip(st.saved.pop(b), st.xs)]
            self._drop_params(st, b)
            st.weights.pop(b)
            self.hand_off(st, b)

    # ---------------------------------------------------------------- optimizer hand-off
    def hand_off(self, st: StepState, b: int) -> None:
        """Block ``b``'s gradient is complete: send it to the Adam stage (or park it)."""
        e = self.e
        grad = st.grads.pop(b)
        sq = sum_squares(grad)
        st.norm_sq += sq
        st.finite = st.finite and math.isfinite(sq)
        if e.plan.schedule == "overlap_next_forward" or (st.finite and b in self._held_back()):
            st.parked[b] = e.parking.park(b, grad)
        elif st.finite:
            if b == 0:  # the whole step is finite: RAM-tier blocks held back may update now
                for o in sorted(st.parked, reverse=True):
                    st.written[o] = e.stage.update(o, *e.parking.source(st.parked.pop(o)), e.lr, e.step + 1, 1.0)
            buf, ready = e.stage.offload(b, grad)
            st.written[b] = e.stage.update(b, buf, ready, e.lr, e.step + 1, 1.0)

    def _held_back(self) -> range:
        """overlap_backward: blocks whose update waits for block 0 (RAM tier; see the module docstring)."""
        p = self.e.plan
        return rollback_blocks(p.ram_weight_blocks, p.ram_state_blocks, p.schedule)

    def finish(self, st: StepState) -> bool:
        """After backward: commit (overlap_backward) or submit clipped updates (next_forward).

        Returns whether an update was applied (False: non-finite gradient, step skipped).
        """
        e = self.e
        if e.plan.schedule == "overlap_backward":
            wait(list(st.written.values()))
            for p in st.parked.values():  # held-back RAM-tier gradients of a non-finite step
                e.parking.discard(p)
            st.parked.clear()
            if not st.finite:
                e.stage.worker.wait()
                e.tier.abort()
                return False
            for f in st.written.values():
                f.result()
            e.step += 1
            e.tier.commit(e.commit_meta())
            return True
        if not st.finite:
            for p in st.parked.values():
                e.parking.discard(p)
            return False
        norm = math.sqrt(st.norm_sq)
        scale = min(1.0, e.max_grad_norm / (norm + 1e-6)) if e.max_grad_norm else 1.0
        for b in range(len(e.layout.blocks)):
            e.pending[b] = e.stage.update(b, *e.parking.source(st.parked.pop(b)), e.lr, e.step + 1, scale)
        e.step += 1
        return True


def settle(engine: "object") -> None:
    """Overlap_next_forward: wait for the previous step's updates and commit them."""
    e = engine
    if not e.pending:
        return
    futs = list(e.pending.values())
    e.pending.clear()
    wait(futs)
    for f in futs:
        f.result()
    e.tier.commit(e.commit_meta())


def gate_for(engine: "object") -> "callable":
    """Loader gate: block b's weights may be read once the pending update of b has written them."""
    return lambda b: engine.pending.get(b, done_future())
