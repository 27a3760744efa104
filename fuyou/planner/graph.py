"""One training step as operations with dependencies, for the discrete-event simulator (``sim.Sim``).

The graph follows the step's own rules (``fuyou.schedule.rules``: the schedule, the load order, which
gradients park and where, which RAM-tier blocks are held back) and the engine's phases (forward,
turnaround, backward, finish: ``fuyou/engine/step.py``); what it adds is what each operation costs
and which resource it occupies. Resources: ``ssd`` (reads and writes share one server), ``h2d``,
``d2h``, ``compute``, ``adam``, ``ram_copy`` (the RAM tier's copy thread) and ``thread`` (the Python
training thread); on a ``cpu`` device all but ``ssd`` are one server, the cores. Modelled beyond the
rules:

* weights — a block's SSD read is issued once the copy ``prefetch_depth`` + 1 positions earlier is
  done (that many host weight buffers); RAM-tier reads are memcpys on the RAM tier's copy thread
  (``fuyou.transfer.ram_tier``), once the gate (last step's update of the block) allows.
* activations — ``swap_cpu`` copies synchronously on the compute stream (pageable); ``swap_ssd`` also
  packs on the thread and writes, read back a block ahead; ``recompute`` runs forward again.
* backward — the flat gradient buffer zeroed, the backward FLOPs, and for layers the add of fresh
  weight gradients into it (``grad_add_rate``; the head accumulates in its GEMM, the embedding scatters).
* hand-off — the gradient norm syncs the thread with compute; device→host copy; Adam per state chunk
  (SSD read → Adam on one FIFO worker → SSD write), the new weights written after the last chunk. The
  training thread blocks on the 2 gradient buffers only; the Adam stage's feeder thread
  (``fuyou.engine.adam_stage``) takes the queued updates in order and blocks on the 2 new-weight and
  ``state_buffers`` state buffers, so a step's updates overlap whatever the training thread does next;
  parked gradients on SSD are written after their copy and read back (by the feeder, into a gradient
  buffer) before their Adam; with the clipping schedule the
  next step's forward takes block b's new weights from Adam's buffer (a memcpy by the Adam worker once
  Adam(b) is done: ``fuyou.transfer.new_weights``), its later reads of b wait for Adam(b)'s weight
  write, and its finish, before it submits its own updates, waits for every write (``settle``). The
  engine holds each such buffer until the forward's claim, so every forward read is handed over; later
  reads go to the SSD.

Data parallel (``StepConfig.cluster``, ``fuyou.schedule.shards``): every byte a rank reads, writes,
copies or updates is its shard's (``ModelShape.sharded``); each block's weights are all-gathered on
a ``comm`` resource after their upload, before forward and again before backward, and its gradient is
reduce-scattered after backward, before the norm and the copy off; the step agrees on the gradient
norm and finiteness (one all-reduce) before the updates (clipping) or the commit. On the ``cpu``
device ``comm`` is the cores too (gloo copies with the CPU).

Blocks under ``recompute_cpu`` copy their input off the device after forward and back before
backward. On a CUDA device swaps and those copies run on the copy streams, overlapped with compute
and read back ahead (``fuyou.transfer.activation_copies``); on the CPU device a copy is a memcpy on
the training thread and adds to compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuyou.planner.cluster import Cluster
from fuyou.planner.profile import HardwareProfile
from fuyou.planner.sim import Sim
from fuyou.schedule import rules
from fuyou.schedule.plan import RECOMPUTES, Plan
from fuyou.schedule.shapes import ModelShape
from fuyou.schedule.shards import collective_bytes
from fuyou.schedule.sizing import state_chunks
from fuyou.schedule.state_format import FORMATS, StateFormat


@dataclass(frozen=True)
class StepConfig:
    """What one step runs besides the ``Plan``: batch shape, element sizes, how the device copies."""

    micro_batch_size: int
    seq_len: int
    compute_bytes: int = 2
    """Bytes per element of the compute dtype (``--precision``): 2 for bf16, 4 for fp32. Weights,
    gradients, block inputs and activations on the device and in host buffers are this size."""
    cluster: Cluster = Cluster()
    """The data-parallel ranks; ``micro_batch_size`` and the plan's accumulation are per rank."""
    adapter_params: int = 0
    """LoRA: the adapters' parameters, resident on the device in fp32 with their gradients and AdamW
    moments (16 B each: ``fuyou.engine.lora``)."""
    device_memory: int = 0
    """The device budget (bytes; 0: none given), which bounds the loss's logit chunk
    (``sizing.loss_chunk_tokens``)."""
    optimizer_state: str = "fp32"
    """The state's format (``fuyou.schedule.state_format``): its bytes per chunk, and whether a split
    master's update first reads the block's compute weights."""

    @property
    def state_format(self) -> StateFormat:
        """The ``StateFormat`` of ``optimizer_state``."""
        return FORMATS[self.optimizer_state]

    @property
    def state_bytes_per_param(self) -> float:
        """Bytes per parameter of a state chunk (``StateFormat.state_bytes``: fp32 master + m + v = 12)."""
        return self.state_format.state_bytes(self.compute_bytes)


class StepGraph:
    """Builds ``steps`` consecutive steps of one plan into a ``Sim``; see the module docstring."""

    def __init__(self, shape: ModelShape, plan: Plan, cfg: StepConfig, prof: HardwareProfile) -> None:
        plan = rules.resolve(plan, clip=False)  # ``auto``: the planner's caller did not ask for clipping
        self.m, self.p, self.c, self.hw = shape, plan, cfg, prof
        self.world = cfg.cluster.world
        self.own = shape.sharded(self.world)
        """What this rank stores and updates (its shards); ``self.m`` is what it computes on."""
        self.comm_bytes = 0.0
        """Bytes this rank's collectives moved in the last step built."""
        self.cpu = prof.device == "cpu"
        merge = {r: "cpu" for r in ("h2d", "d2h", "compute", "adam", "thread", "comm", "ram_copy")} if self.cpu else {}
        self.sim = Sim(merge)
        H = len(shape.blocks) - 1
        self.H = H
        self.route_holders = set(shape.route_holders())
        self.last_gradient = min((b for b, blk in enumerate(shape.blocks) if not blk.frozen), default=-1)
        """The block whose gradient completes backward (the lowest that trains)."""
        tied = [i for i, b in enumerate(shape.blocks) for o in shape.blocks[H].borrows if b.name == o]
        self.F = H + 1 - rules.head_count([b.name for b in shape.blocks])
        """The head's first block (H, or the first of its vocabulary groups: ``fuyou.schedule.vocab``)."""
        kinds = [blk.kind for blk in shape.blocks]
        self.weightless = rules.weightless_backward(kinds, plan)
        """Blocks whose backward loads no weights (``rules.weightless_backward``: the embedding)."""
        self.order = rules.load_order(H + 1, tied, H + 1 - self.F, self.weightless)
        self.first_pos = {b: self.order.index(b) for b in range(H + 1)}
        """Each block's first position in the load order: the read the new weights are handed to."""
        self.parked = set(rules.parked(H + 1, plan))
        self.K = plan.grad_accum
        self.mb_tokens = cfg.micro_batch_size * cfg.seq_len
        self.thread: int | None = None
        self.compute: int | None = None
        self.feeder: int | None = None
        """The Adam stage's feeder thread (a chain of sync points): it takes each queued update in
        order and waits for that update's new-weight and state buffers."""
        self.prev_writes: dict[int, int] = {}
        self.prev_done: dict[int, int] = {}
        self.prev_all: list[int] = []
        self.ends: list[int] = []

    # ------------------------------------------------------------------ durations (s)
    def _w_bytes(self, b: int) -> int:
        """Bytes of block ``b``'s trained compute weights (or gradient) this rank stores and moves: its shard."""
        return self.c.compute_bytes * self.own.blocks[b].numel

    def _f_bytes(self, b: int) -> int:
        """Bytes of block ``b``'s read-only part (``BlockShape.frozen_numel``) this rank stores and reads."""
        return self.c.compute_bytes * self.own.blocks[b].frozen_numel

    def _collective(self, b: int, kind: str, after: int) -> int:
        """An all-gather (every weight) or reduce-scatter (the trained part's gradient) of block ``b``'s
        flat vector on ``comm``, after op ``after`` (one rank: no collective, ``after`` itself)."""
        if self.world == 1:
            return after
        blk = self.m.blocks[b]
        nbytes = collective_bytes(blk.numel, self.world, self.c.compute_bytes)
        if kind == "all_gather" and blk.frozen_numel:
            nbytes += collective_bytes(blk.frozen_numel, self.world, self.c.compute_bytes)
        self.comm_bytes += nbytes
        return self.sim.op("comm", self.c.cluster.collective_s(nbytes), (after,), kind)

    def _all_reduce(self) -> None:
        """The step's agreement on the gradient norm and finiteness (a few bytes: the latency)."""
        if self.world > 1:
            self._t(self.sim.op("comm", self.c.cluster.latency_s, (self.thread,), "all_reduce"))

    def _fwd_s(self, b: int) -> float:
        blk, hw = self.m.blocks[b], self.hw
        if blk.kind == "embed":
            return self.K * self.mb_tokens * self.m.hidden * self.c.compute_bytes / hw.device_mem_Bps
        f = blk.fwd_flops_per_token(self.m.hidden, self.c.seq_len) * self.mb_tokens
        return self.K * f / hw.flops_per_s(self.mb_tokens, head=blk.kind == "head")

    def _bwd_s(self, b: int) -> float:
        """Backward of block ``b`` over the step's micro-batches: the flat gradient buffer zeroed once,
        then per micro-batch the backward proper and, for layers, autograd adding the fresh weight
        gradients into the preset buffer (``grad_add_rate``). The head adds its weight gradient in its
        GEMM (``adapters.HeadLinear``); the embedding's backward is sparse, a scatter of the tokens' rows."""
        blk, hw = self.m.blocks[b], self.hw
        if self.p.lora_base or blk.frozen:  # LoRA, --freeze: input gradients only, nothing for a frozen embedding
            if blk.kind == "embed":
                return 0.0
            f = blk.fwd_flops_per_token(self.m.hidden, self.c.seq_len) * self.mb_tokens
            return self.K * f / hw.flops_per_s(self.mb_tokens, backward=True, head=blk.kind == "head")
        zero = self.c.compute_bytes * blk.numel / hw.device_mem_Bps
        if blk.kind == "embed":
            return zero + self.K * self.mb_tokens * self.m.hidden * self.c.compute_bytes / hw.device_mem_Bps
        add = blk.numel / hw.grad_add_rate if blk.kind in ("layer", "experts") else 0.0
        f = 2 * blk.fwd_flops_per_token(self.m.hidden, self.c.seq_len) * self.mb_tokens
        return zero + self.K * (add + f / hw.flops_per_s(self.mb_tokens, backward=True, head=blk.kind == "head"))

    def act_bytes(self, b: int) -> float:
        """Bytes block ``b`` saves for backward over all micro-batches of a step: measured by the
        profile (a whole layer, scaled to this run's compute dtype) or by the model's description
        (``ModelShape.memory``)."""
        blk = self.m.blocks[b]
        measured = self.hw.layer_act_bytes_per_token and self.hw.model_signature == self.m.signature
        if blk.kind == "layer" and measured and self.m.expert_groups == 1:  # measured: a whole layer
            per = self.hw.layer_act_bytes_per_token * self.c.compute_bytes / self.hw.compute_bytes
        else:
            per = self.m.memory(b, self.c.compute_bytes, self.c.seq_len).saved_per_token
        return per * self.K * self.mb_tokens

    def _policy(self, b: int) -> str:
        return "keep" if b >= self.F else self.p.policy(b, self.H + 1)

    # ------------------------------------------------------------------ building blocks
    def _t(self, *deps: int | None) -> int:
        """Advance the training thread past ``deps``."""
        self.thread = self.sim.op(None, 0.0, (self.thread,) + deps)
        return self.thread

    def _next(self, pos: int) -> int:
        """Loader ``next(pos)``: wait for the read, copy to the device, issue the read depth+1 ahead."""
        b = self.order[pos]
        self._t(self.reads[pos])
        cp = self.sim.op("h2d", (self._w_bytes(b) + self._f_bytes(b)) / self.hw.h2d_Bps, (self.thread,))
        if self.cpu:
            self._t(cp)
        self._issue(pos + self.p.prefetch_depth + 1, (cp, self.thread))
        return self._collective(b, "all_gather", cp)

    def _issue(self, pos: int, deps: tuple[int | None, ...]) -> None:
        if pos >= len(self.order):
            return
        b = self.order[pos]
        gate = self.prev_writes.get(b)  # overlap_next_forward: Adam(b) of the last step wrote w(b)
        if (
            gate is not None and pos == self.first_pos[b] and b >= self.p.ram_weight_blocks
        ):  # its first read: handed over
            cp = self._w_bytes(b) / self.hw.host_mem_Bps
            self.reads[pos] = self.sim.op("adam", cp, deps + (self.prev_done[b],), "handoff")
            if self._f_bytes(b):  # the read-only part still comes from the SSD
                frozen = self._ssd(self._f_bytes(b), "ssd_read", deps)
                self.reads[pos] = self.sim.op(None, 0.0, (self.reads[pos], frozen))
        elif b < self.p.ram_weight_blocks:  # RAM tier: a memcpy into the host buffer on the tier's copy
            # thread, no SSD read, once the gate (last step's update of the block) allows
            cp = (self._w_bytes(b) + self._f_bytes(b)) / self.hw.host_mem_Bps
            self.reads[pos] = self.sim.op("ram_copy", cp, deps + (gate,), "ram_read")
        else:
            self.reads[pos] = self._ssd(self._w_bytes(b) + self._f_bytes(b), "ssd_read", deps + (gate,))

    def _compute(self, dur: float, *deps: int | None, sync: bool = False) -> int:
        self.compute = self.sim.op("compute", dur, (self.compute, self.thread) + deps)
        if self.cpu or sync:
            self._t(self.compute)
        return self.compute

    # ------------------------------------------------------------------ phases
    def step(self, start: int | None) -> None:
        """Append one step; ``start`` is the op the step begins after."""
        self.first_op = len(self.sim.res)
        self.comm_bytes = 0.0
        self.thread = start
        self.reads: dict[int, int] = {}
        self.act_ssd: dict[int, int] = {}
        self.grad_rel: list[int] = []
        self.ww_rel: list[int] = []
        self.state_rel: list[int] = []
        self.writes: dict[int, int] = {}
        self.done: dict[int, int] = {}
        self.all_writes: list[int] = []
        self.parked_grads: dict[int, int] = {}
        self.on_ssd: set[int] = set()
        for pos in range(min(self.p.prefetch_depth + 1, len(self.order))):
            self._issue(pos, (start,))
        self.forward()
        self.turnaround()
        self.backward()
        self.finish()

    def boundary_bytes(self, b: int, pol: str) -> int:
        """Bytes of block ``b``'s input the step copies off the device and back (``recompute_cpu``; an
        expert group keeps no input, a layer's last its route: ``ModelShape.route_holders``)."""
        offloaded = pol == "recompute_cpu" and (self.m.blocks[b].keeps_input or b in self.route_holders)
        return offloaded * self.K * self.mb_tokens * self.m.hidden * self.c.compute_bytes

    def forward(self) -> None:
        swap_out = self.hw.swap_Bps[0]
        for b in range(self.F):
            cp = self._next(b)
            pol = self._policy(b)
            a = self.act_bytes(b)
            swapped = pol in ("swap_cpu", "swap_ssd")
            boundary = self.boundary_bytes(b, pol)
            if self.hw.device == "cuda":  # copy stream, overlapped with the next block's compute
                f = self._compute(self._fwd_s(b), cp)
                out = self.sim.op("d2h", (a * swapped + boundary) / self.hw.d2h_Bps, (f,))
                if pol == "swap_ssd":
                    self.act_ssd[b] = self._ssd(a, "ssd_write", (out,))
                continue
            extra = a / swap_out if swapped else 0.0
            self._compute(self._fwd_s(b) + extra + boundary / self.hw.d2h_Bps, cp, sync=swapped)
            if pol == "swap_ssd":
                self.thread = self.sim.op("thread", a / self.hw.host_mem_Bps, (self.thread,))
                self.act_ssd[b] = self._ssd(a, "ssd_write", (self.thread,))

    def turnaround(self) -> None:
        """The head's forward, loss and backward (``fuyou.engine.turnaround``): one block, or its
        vocabulary groups twice — forward F…H, then backward H…F, each recomputing its logits (the
        groups but the last read again)."""
        H, F = self.H, self.F
        if F == H:
            cps = [self._next(pos) for pos in range(H, H + 1 + len(self.m.blocks[H].borrows))]
            bwd = self._compute(self._fwd_s(H) + self._bwd_s(H), *cps, sync=True)
            self.hand_off(H, bwd)
            return
        for b in range(F, H + 1):
            self._compute(self._fwd_s(b), self._next(b))
        for i, b in enumerate(range(H, F - 1, -1)):
            cp = self._next(H + i) if b < H else None
            self.hand_off(b, self._compute(self._fwd_s(b) + self._bwd_s(b), cp, sync=True))

    def backward(self) -> None:
        swap_in = self.hw.swap_Bps[1]
        pos = self.H + 1 + len(self.m.blocks[self.H].borrows) + (self.H - self.F)
        act_reads: dict[int, int] = {}
        self.prefetch_from = self.thread
        for b in range(self.F - 1, -1, -1):
            for a in (b, b - 1):
                if a in self.act_ssd and a not in act_reads:
                    act_reads[a] = self._ssd(self.act_bytes(a), "ssd_read", (self.thread, self.act_ssd[a]))
            cp = None if b in self.weightless else self._next(pos)
            pos += b not in self.weightless
            pol = self._policy(b)
            swapped = pol in ("swap_cpu", "swap_ssd")
            boundary = self.boundary_bytes(b, pol)
            dur = self._bwd_s(b) + (self._fwd_s(b) if pol in RECOMPUTES else 0.0)
            if self.hw.device == "cuda":  # back in on the copy stream, issued a block ahead
                back = self.sim.op(
                    "h2d",
                    (self.act_bytes(b) * swapped + boundary) / self.hw.h2d_Bps,
                    (self.prefetch_from, act_reads.get(b)),
                )
                self.prefetch_from = self.compute
                self.hand_off(b, self._compute(dur, cp, back))
                continue
            dur += self.act_bytes(b) / swap_in if swapped else 0.0
            dur += boundary / self.hw.h2d_Bps
            self.hand_off(b, self._compute(dur, cp, act_reads.get(b)))

    # ------------------------------------------------------------------ optimizer
    @staticmethod
    def _free(released: list[int], count: int) -> int | None:
        """The release a thread taking one of ``count`` buffers (released in the order ``released``)
        waits for: the ``count``-th last; None while fewer than ``count`` are out."""
        return released[len(released) - count] if len(released) >= count else None

    def _acquire(self, released: list[int], count: int) -> None:
        """The training thread takes one of ``count`` buffers (``_free``)."""
        if (op := self._free(released, count)) is not None:
            self._t(op)

    def _feed(self, *deps: int | None) -> int:
        """Advance the feeder thread past ``deps``."""
        self.feeder = self.sim.op(None, 0.0, (self.feeder,) + deps)
        return self.feeder

    def _feeder_acquire(self, released: list[int], count: int) -> None:
        """The feeder takes one of ``count`` buffers (``_free``)."""
        if (op := self._free(released, count)) is not None:
            self._feed(op)

    def _ssd(self, nbytes: float, kind: str, deps: tuple) -> int:
        """An SSD read or write of ``nbytes``; on the cpu device also the CPU time the I/O path takes
        (kernel, checksums: ``io_cpu_s_per_byte``), charged whole to the cores' one server: it stalls
        compute and Adam for as long (``HardwareProfile.io_cpu_s_per_byte``), and it is part of the
        transfer: a write's checksum before its bytes go out, a read's check after they land, so where
        compute holds the cores a read lands late (its user waits for both; the returned operation)."""
        bps = self.hw.ssd_read_Bps if kind == "ssd_read" else self.hw.ssd_write_Bps
        if not (self.cpu and self.hw.io_cpu_s_per_byte > 0):
            return self.sim.op("ssd", nbytes / bps, deps, kind)
        host = nbytes * self.hw.io_cpu_s_per_byte
        if kind == "ssd_write":  # the checksum is taken before the bytes go out
            return self.sim.op("ssd", nbytes / bps, (self.sim.op("thread", host, deps, "io_cpu"),), kind)
        return self.sim.op("thread", host, (self.sim.op("ssd", nbytes / bps, deps, kind),), "io_cpu")

    def hand_off(self, b: int, bwd: int) -> None:
        """Gradient reduce-scatter (data parallel), norm (a read of the gradient on the device, then a
        sync), device→host copy, then Adam now (overlap_backward) or parked. A frozen base
        (``Plan.lora_base``: LoRA) or a block frozen whole (``--freeze``) hands nothing off."""
        if self.p.lora_base or self.m.blocks[b].frozen:
            self._t(bwd) if self.cpu else None
            return
        bwd = self._collective(b, "reduce_scatter", bwd)
        self._t(bwd)
        self._t(self.sim.op("compute", self.own.blocks[b].numel / self.hw.grad_norm_rate, (self.thread,), "norm"))
        if b in self.parked:  # ``rules.parked``: every block with clipping, held-back RAM-tier blocks without
            d = self.sim.op("d2h", self._w_bytes(b) / self.hw.d2h_Bps, (self.thread, bwd))
            if self.cpu:
                self._t(d)
            if not self.p.parks_in_ram(b):  # parked on SSD (``grad_park``)
                d = self._ssd(self._w_bytes(b), "ssd_write", (d,))
                self.on_ssd.add(b)
            self.parked_grads[b] = d
            return
        self._acquire(self.grad_rel, 2)
        d = self.sim.op("d2h", self._w_bytes(b) / self.hw.d2h_Bps, (self.thread, bwd))
        if self.cpu:
            self._t(d)
        if b == self.last_gradient:
            for o in sorted(self.parked_grads, reverse=True):
                self.update(o, self.parked_grads.pop(o))
        self.update(b, d)

    def update(self, b: int, grad: int) -> None:
        """Adam for block ``b``, chunk by chunk, and the new weights' write."""
        hw, n = self.hw, self.own.blocks[b].numel
        self._feed(self.thread)  # the training thread queued it; the feeder takes it in order
        if b in self.on_ssd:  # the parked gradient comes back from SSD first, into a gradient buffer
            self._feed(grad)
            self._feeder_acquire(self.grad_rel, 2)
            grad = self._ssd(self._w_bytes(b), "ssd_read", (self.feeder,))
        self._feeder_acquire(self.ww_rel, 2)
        old = self.feeder
        if self.c.state_format.split:  # the master's top half: the old weights, read first
            if b < self.p.ram_weight_blocks:
                old = self.sim.op("thread", self._w_bytes(b) / hw.host_mem_Bps, (self.feeder,))
            else:
                old = self._ssd(self._w_bytes(b), "ssd_read", (self.feeder,))
        in_ram = b < self.p.ram_state_blocks
        adam_rate = hw.adam_rate(bool(self.c.state_format.quant_block))
        jobs, writes = [], []
        for lo, hi in state_chunks(n, self.p.state_chunk):
            k = hi - lo
            nbytes = self.c.state_format.chunk_bytes(k, self.c.compute_bytes)
            if in_ram:  # RAM tier: Adam updates the resident state in place (no copies)
                jobs.append(self.sim.op("adam", k / adam_rate, (old, grad)))
                continue
            self._feeder_acquire(self.state_rel, self.p.state_buffers)
            rd = self._ssd(nbytes, "ssd_read", (self.feeder,))
            jobs.append(self.sim.op("adam", k / adam_rate, (rd, grad, old)))
            writes.append(self._ssd(nbytes, "ssd_write", (jobs[-1],)))
            self.state_rel.append(writes[-1])
        done = self.sim.op(None, 0.0, jobs)
        self.done[b] = done
        self.grad_rel.append(done)
        if b < self.p.ram_weight_blocks:
            ww = self.sim.op("thread", self._w_bytes(b) / hw.host_mem_Bps, (done,))
        else:
            ww = self._ssd(self._w_bytes(b), "ssd_write", (done,))
        self.ww_rel.append(ww)
        self.writes[b] = ww
        self.all_writes += writes + [ww]

    def finish(self) -> None:
        if self.p.lora_base:  # LoRA: the adapters' update is on the device (measured); nothing is written
            self.prev_writes, self.prev_all, self.prev_done = {}, [], {}
            self._compute(self.hw.lora_step_s, sync=True)
            self.ends.append(self._t(self.compute))
            return
        self._all_reduce()
        if not self.p.clips:
            self._t(*self.all_writes)
            self.thread = self.sim.op("thread", self.hw.commit_s, (self.thread,))
            self.prev_writes, self.prev_all, self.prev_done = {}, [], {}
        else:
            if self.prev_all:  # settle: the previous step's updates must be written and committed
                self._t(*self.prev_all)
                self.thread = self.sim.op("thread", self.hw.commit_s, (self.thread,))
            for b in sorted(self.parked_grads):
                self.update(b, self.parked_grads[b])
            self.prev_writes, self.prev_all = dict(self.writes), list(self.all_writes)
            self.prev_done = dict(self.done)
        self.ends.append(self._t())


def simulate(
    shape: ModelShape, plan: Plan, cfg: StepConfig, prof: HardwareProfile
) -> tuple[float, dict[str, float], float]:
    """Steady-state step time (s), busy seconds per resource kind of that step, and the bytes one
    rank's collectives move in it.

    ``overlap_backward`` steps are independent: one is simulated. ``overlap_next_forward`` overlaps
    a step's Adam with the next forward: two are simulated and the second is timed.
    """
    g = StepGraph(shape, plan, cfg, prof)
    n = 2 if g.p.clips else 1
    start = None
    for _ in range(n):
        g.step(start)
        start = g.ends[-1]
    ends = g.sim.run()
    t = ends[g.ends[-1]] - (ends[g.ends[-2]] if n == 2 else 0.0)
    busy: dict[str, float] = {}
    for k, d in zip(g.sim.kind[g.first_op :], g.sim.dur[g.first_op :]):
        busy[k] = busy.get(k, 0.0) + d
    return t, busy, g.comm_bytes
