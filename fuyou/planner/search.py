"""Plan search: the fastest predicted plan that fits the budgets, or an error naming the binding one.

Stages (every candidate is scored by ``cost.predict``; the best seen wins):

1. micro-batch size — every divisor of the step's sequences (``tokens_per_step / seq_len``) whose
   device working set fits; accumulation K = sequences ÷ micro-batch.
2. activations — layers (a split layer with its expert groups) ordered by benefit per byte
   (recompute FLOPs ÷ saved bytes, highest first;
   ties: later layers first, their activations are needed first in backward); the first n of them
   are saved — kept on the device while it has room, then swapped to host RAM while the host budget
   has room, then to SSD — the rest recomputed. n is scanned over a fixed grid 0…L (the same grid
   for any budget, so more memory can only turn a swap into a cheaper one). Recomputed layers keep
   their inputs on the device (``recompute``) or, in a second search taken when nothing else fits or
   when it is predicted ≥ 1 % faster (larger micro-batches), in host RAM (``recompute_cpu``).
3. prefetch depth, then state chunk × state buffers, under the host budget; then n again.
4. schedule — clipping forces ``overlap_next_forward``; otherwise the faster of the two.
5. RAM tiers (``Request.ram_tiers``) — spare host RAM filled with bf16 weights, then optimizer state
   (RAM absorbs the most-read/written bytes first), kept if predicted ≥ 1 % faster; executable
   (``fuyou.transfer.ram_tier``): the returned ``Plan`` carries ``ram_weight_blocks``/``ram_state_blocks``.

Host memory is counted, and shrunk to fit, by the engine's own rules (``fuyou.schedule.sizing``), so
a returned plan is one the engine accepts and runs as it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from fuyou.errors import ConfigError
from fuyou.planner.cluster import Cluster
from fuyou.planner.cost import Memory, Prediction, device_peak, footprint, host_buffers, memory, predict
from fuyou.planner.graph import StepConfig
from fuyou.planner.profile import HardwareProfile
from fuyou.planner.result import Budgets, PlannerResult
from fuyou.schedule import sizing
from fuyou.schedule.experts import expert_group_options
from fuyou.schedule.plan import MIN_CHUNK, RECOMPUTES, Plan
from fuyou.schedule.shapes import ModelShape
from fuyou.schedule.state_format import DEFAULT_FORMAT, state_format
from fuyou.schedule.vocab import bounding_groups
from fuyou.units import format_size as fs, parse_size

CHUNKS = (1 << 20, 1 << 22, 1 << 23, 1 << 25)
MAX_CHUNKS = 32
"""Chunk sizes searched leave at most this many state chunks per block: finer chunks only shorten a
head/tail already under 1/32 of a block's Adam time, and cost simulation time."""
DEPTHS = (1, 2, 3, 4)
MARGIN = 0.02
"""A candidate replaces the plan found so far only if predicted this much faster: candidates are tried
from the engine's defaults outwards, and a knob is not moved for a gain inside the model's own error
(measured: moving to 1.5 Mi-element state chunks for a predicted 0.6 % ran 9 % slower)."""
_Best = tuple[float, Plan, StepConfig, Prediction]
"""The fastest candidate so far: predicted step time, the plan, its step config, the prediction."""
_B = TypeVar("_B", _Best, _Best | None)  # a candidate found stays found: _try/_scan never return None for one


def _chunk_for(numel: int, chunks: int) -> int:
    """The state chunk (a multiple of 32 elements) that cuts ``numel`` into ``chunks`` pieces."""
    per_chunk = -(-numel // chunks)  # ceil(numel / chunks)
    return -(-per_chunk // 32) * 32


class InfeasibleError(ConfigError):
    """No plan fits the budgets; the message names the binding constraint, numbers and a fix."""


class BlockTooLargeError(InfeasibleError):
    """The largest block alone does not fit a budget (its weights and gradients on the device, or its
    smallest set of host buffers): smaller blocks (more expert groups) may."""


@dataclass(frozen=True)
class Request:
    """What to plan for, and any choice the user fixed."""

    seq_len: int = 1024
    tokens_per_step: int = 8192
    clip: bool = False
    """Global-norm clipping wanted (forces ``overlap_next_forward``)."""
    optimizer_state: str = DEFAULT_FORMAT
    """How AdamW's state is stored (``--optimizer-state``: ``fuyou.schedule.state_format``; the default is a new
    run's, as ``EngineConfig``'s ``auto``)."""
    micro_batch_size: int | None = None
    schedule: str | None = None
    prefetch_depth: int | None = None
    activations: str | None = None
    """One policy for every layer instead of searching (keep|swap_cpu|swap_ssd|recompute)."""
    ram_tiers: bool = True
    """Consider keeping the first blocks' weights, then optimizer state, in host RAM when it is
    predicted faster."""
    precision: str = "bf16"
    """Compute dtype (``--precision`` after ``auto`` is resolved): bf16 (2 B/element) or fp32 (4)."""
    cluster: Cluster = Cluster()
    """Data-parallel ranks: ``tokens_per_step`` is the global batch, split evenly over them."""
    lora_base: bool = False
    """LoRA on a frozen base (``Plan.lora_base``): weights are only read; no gradients, state or writes."""
    lora_rank: int = 0
    """With ``lora_base``: the adapters' rank, for their device memory (``all-linear``: every linear layer)."""


def plan_inputs(
    prof: HardwareProfile,
    *,
    cpu_memory: str | int | None,
    gpu_memory: str | int | None = None,
    ssd_space: str | int | None = None,
    seq_len: int = 1024,
    tokens_per_step: int | None = None,
    clip: bool = False,
    optimizer_state: str = DEFAULT_FORMAT,
    precision: str = "bf16",
    micro_batch_size: int | None = None,
    schedule: str | None = None,
    prefetch_depth: int | None = None,
    activations: str | None = None,
    cluster: Cluster | None = None,
    lora_rank: int | None = None,
) -> tuple[Budgets, Request]:
    """The budgets and the request the search gets for a run of these settings, whichever front end
    describes it (``fuyou plan``, ``fuyou finetune``'s plan chooser, the frontier bench), so their plans
    cannot drift apart. Sizes are bytes or strings such as ``64GiB``. Left out: the host budget is 3/4 of
    the profile's RAM ÷ the node's ranks (they share it), the device budget the profile's device memory,
    the SSD room unbounded (0), the step 8 sequences, the ranks one. ``lora_rank`` (None: full
    fine-tuning) plans LoRA on a frozen base.

    Raises ConfigError for an unreadable size."""
    cluster = cluster or Cluster()
    bud = Budgets(
        cpu_memory=(
            parse_size(cpu_memory, "--cpu-memory")
            if cpu_memory is not None
            else prof.host_memory_bytes * 3 // 4 // cluster.gpus_per_node
        ),
        gpu_memory=parse_size(gpu_memory, "--gpu-memory") if gpu_memory is not None else prof.device_memory_bytes,
        ssd_bytes=parse_size(ssd_space, "--ssd-space") if ssd_space is not None else 0,
    )
    req = Request(
        seq_len=seq_len,
        tokens_per_step=tokens_per_step or 8 * seq_len,
        clip=clip,
        optimizer_state=optimizer_state,
        micro_batch_size=micro_batch_size,
        schedule=schedule,
        prefetch_depth=prefetch_depth,
        activations=activations,
        precision=precision,
        cluster=cluster,
        lora_base=lora_rank is not None,
        lora_rank=lora_rank or 0,
    )
    return bud, req


class _Search:
    def __init__(self, shape: ModelShape, prof: HardwareProfile, bud: Budgets, req: Request, offload: bool) -> None:
        self.m, self.hw, self.b, self.r = shape, prof, bud, req
        self.rc = "recompute_cpu" if offload else "recompute"
        """What a layer whose activations are not saved runs: its input on the device or in host RAM."""
        self.H = len(shape.blocks) - 1
        world = req.cluster.world
        seqs = max(1, math.ceil(req.tokens_per_step / req.seq_len))
        if seqs % world:
            raise ConfigError(
                f"the {seqs} sequences of a step (--tokens-per-step / --seq-len) do not split evenly over "
                f"{world} ranks; make --tokens-per-step a multiple of {world * req.seq_len}"
            )
        self.seqs = seqs // world
        """Sequences per step on each rank."""
        self.own = shape.sharded(world)
        """What one rank stores (its shards)."""
        self.cb = 4 if req.precision == "fp32" else 2
        self.fmt = state_format(req.optimizer_state, resumable=True)
        self.spp = self.fmt.state_bytes(self.cb)
        self.park: int | None = None
        """``Plan.park_ram_blocks`` of every candidate with the clipping schedule (None: all in RAM)."""
        self.evals = 0
        self._memories: dict[tuple[Plan, StepConfig], Memory] = {}
        layers = [b for b in range(1, self.H) if shape.blocks[b].kind == "layer"]
        self.members = {b: [b] for b in layers}
        """Layer → its blocks: itself and, split into expert groups, the groups, which share its policy."""
        for b in range(1, self.H):
            if shape.blocks[b].kind == "experts":
                self.members[max(a for a in layers if a < b)].append(b)
        ob = {
            b: sum(shape.blocks[m].fwd_flops_per_token(shape.hidden, req.seq_len) for m in self.members[b])
            / max(sum(shape.memory(m, 2, req.seq_len).saved_per_token for m in self.members[b]), 1)
            for b in layers
        }
        self.order = sorted(layers, key=lambda b: (-ob[b], -b))
        grid = set(range(min(len(layers), 8) + 1)) | {len(layers)}
        x = 8.0
        while x < len(layers):
            grid.add(int(round(x)))
            x *= 1.3
        self.grid = sorted(grid)

    # ------------------------------------------------------------------ candidates
    def plan(self, mb: int, pol: tuple[str, ...], depth: int, bufs: int, sched: str, chunk: int) -> Plan:
        return Plan(
            grad_accum=self.seqs // mb,
            prefetch_depth=depth,
            activation_policy=pol,
            schedule=sched,
            state_buffers=bufs,
            park_ram_blocks=self.park if sched == "overlap_next_forward" else None,
            state_chunk=chunk,
            lora_base=self.r.lora_base,
            expert_groups=self.m.expert_groups,
            vocab_groups=self.m.vocab_groups,
        )

    def cfg(self, mb: int) -> StepConfig:
        return StepConfig(
            mb,
            self.r.seq_len,
            self.cb,
            self.r.cluster,
            self.m.lora_params(self.r.lora_rank),
            self.b.gpu_memory,
            self.r.optimizer_state,
        )

    def memory(self, plan: Plan, cfg: StepConfig) -> Memory:
        """``cost.memory`` of ``plan`` under ``cfg``, each (plan, config) worked out once: the policy
        assignment and the scans ask for the same candidates again (a 13 B search: ~6,900 asks, ~1,000
        distinct)."""
        key = (plan, cfg)
        if key not in self._memories:
            self._memories[key] = memory(self.m, plan, cfg, self.hw)
        return self._memories[key]

    def fits(self, plan: Plan, cfg: StepConfig) -> bool:
        mem = self.memory(plan, cfg)
        return mem.device <= self.b.gpu_memory and mem.host <= self.b.cpu_memory

    def assign(
        self, mb: int, n: int, depth: int, bufs: int, sched: str, chunk: int, cfg: StepConfig
    ) -> tuple[str, ...] | None:
        """Policies with the first ``n`` layers (benefit order) saved in the cheapest tier that fits."""
        pol = self.base_policies()
        if self.r.activations:
            pol = [p if p == "keep" else self.r.activations for p in pol]
            return tuple(pol) if self.fits(self.plan(mb, tuple(pol), depth, bufs, sched, chunk), cfg) else None
        if not self.fits(self.plan(mb, tuple(pol), depth, bufs, sched, chunk), cfg):
            return None
        for b in self.order[:n]:
            for kind in ("keep", "swap_cpu", "swap_ssd"):
                for m in self.members[b]:
                    pol[m] = kind
                if self.fits(self.plan(mb, tuple(pol), depth, bufs, sched, chunk), cfg):
                    break
            else:
                for m in self.members[b]:
                    pol[m] = self.rc
        return tuple(pol)

    def base_policies(self) -> list[str]:
        """``keep`` for the embedding (each vocabulary group) and the head, ``self.rc`` for the rest."""
        return ["keep" if blk.kind in ("embed", "head") else self.rc for blk in self.m.blocks]

    def score(self, plan: Plan, cfg: StepConfig) -> Prediction:
        self.evals += 1
        return predict(self.m, plan, cfg, self.hw)

    def knobs(self, sched: str, chunk: int) -> tuple[int, int, int]:
        """The default depth/buffers with ``chunk``, shrunk by the engine's budget rules
        (``sizing.fit_host``) until the buffers fit beside the block inputs every candidate keeps in host
        RAM (``inputs_in_host``): the state chunk, then (clipping) parked gradients moved to SSD
        (``self.park``), then the depth unless the user fixed it."""
        base = self.plan(1, (), self.r.prefetch_depth or 2, 2, sched, chunk)
        room = self.b.cpu_memory - self.inputs_in_host(base)
        fit = sizing.fit_host(footprint(self.m, self.cfg(1)), base, room, fixed_depth=bool(self.r.prefetch_depth))
        if fit.clips:
            self.park = fit.park_ram_blocks
        return fit.prefetch_depth, fit.state_buffers, fit.state_chunk

    def inputs_in_host(self, plan: Plan) -> int:
        """Host bytes of the block inputs ``recompute_cpu`` offloads when every layer recomputes
        (``base_policies``: the least any candidate of this search holds in host RAM; the step's tokens
        whatever the micro-batch): 0 where recomputed layers keep their inputs on the device. Parked
        gradients must leave this room, or no candidate of the offloading search fits (they can wait on
        SSD; the inputs cannot)."""
        if self.rc != "recompute_cpu":
            return 0
        pol = dataclasses.replace(plan, activation_policy=tuple(self.base_policies()))
        return self.memory(pol, self.cfg(1)).host_activations

    # ------------------------------------------------------------------ the search
    def run(self) -> PlannerResult:
        sched = self._schedules()[0]
        self._check_static(sched)
        big = max(b.numel for b in self.own.blocks)
        depth, bufs, chunk = self.knobs(sched, max(1 << 23, _chunk_for(big, MAX_CHUNKS)))
        mbs = self.micro_batches()
        feasible = [mb for mb in mbs if self.assign(mb, 0, depth, bufs, sched, chunk, self.cfg(mb)) is not None]
        if not feasible:
            self._device_error(mbs[-1], depth, bufs, sched, chunk)
        best: _Best | None = None
        for mb in feasible:
            best = self._scan(mb, depth, bufs, sched, chunk, self.cfg(mb), best)
        assert best is not None  # a feasible micro-batch size has a plan that fits (assign() said so)
        _, plan, cfg, _ = best
        mb = cfg.micro_batch_size
        for d in [self.r.prefetch_depth] if self.r.prefetch_depth else DEPTHS:
            best = self._try(dataclasses.replace(plan, prefetch_depth=d), cfg, best)
        _, plan, cfg, _ = best
        big = max(b.numel for b in self.own.blocks)
        fine = {_chunk_for(big, k) for k in (1, 2, 4, 8, 16, MAX_CHUNKS)}
        for c in sorted(fine | {c for c in CHUNKS if -(-big // c) <= MAX_CHUNKS}):
            nchunks = -(-big // c)
            for s in sorted({2, 4, nchunks + 1}):
                best = self._try(dataclasses.replace(plan, state_buffers=s, state_chunk=c), cfg, best)
        _, plan, cfg, _ = best
        best = self._scan(mb, plan.prefetch_depth, plan.state_buffers, plan.schedule, plan.state_chunk, cfg, best)
        for other in self._schedules()[1:]:
            _, plan, cfg, _ = best
            pol = self.assign(
                mb,
                sum(p not in RECOMPUTES for p in plan.activation_policy[1:-1]),
                plan.prefetch_depth,
                plan.state_buffers,
                other,
                plan.state_chunk,
                cfg,
            )
            if pol is not None:
                best = self._try(dataclasses.replace(plan, schedule=other, activation_policy=pol), cfg, best)
        return self._result(best)

    def micro_batches(self) -> list[int]:
        """The micro-batch sizes searched, largest first: every divisor of a step's sequences, or the
        one the user fixed. Raises ConfigError if that one does not divide them."""
        if not self.r.micro_batch_size:
            return [d for d in range(self.seqs, 0, -1) if self.seqs % d == 0]
        if self.seqs % self.r.micro_batch_size:
            raise ConfigError(
                f"--micro-batch-size {self.r.micro_batch_size} does not divide the "
                f"{self.seqs} sequences of a step (--tokens-per-step / --seq-len)"
            )
        return [self.r.micro_batch_size]

    def experts_set_peak(self, mbs: list[int]) -> bool:
        """Whether, at some micro-batch size of ``mbs``, the device peak of the plan with every layer
        recomputed (``base_policies``) falls in an expert group's phase (``DevicePeak.by_kind``; a tie
        is not: a finer split could not lower it below the other block's)."""
        sched = self._schedules()[0]
        for mb in mbs:
            plan = self.plan(mb, tuple(self.base_policies()), 1, 2, sched, MIN_CHUNK)
            kinds = device_peak(self.m, plan, self.cfg(mb), self.hw.device).by_kind
            if kinds.get("experts", 0) > max(v for k, v in kinds.items() if k != "experts"):
                return True
        return False

    def _schedules(self) -> list[str]:
        if self.r.clip:
            if self.r.schedule == "overlap_backward":
                raise ConfigError(
                    "clipping needs the overlap_next_forward schedule; drop --schedule or --max-grad-norm"
                )
            return ["overlap_next_forward"]
        return [self.r.schedule] if self.r.schedule else ["overlap_backward", "overlap_next_forward"]

    def _try(self, plan: Plan, cfg: StepConfig, best: _B) -> _B:
        if not self.fits(plan, cfg):
            return best
        p = self.score(plan, cfg)
        return (p.step_s, plan, cfg, p) if best is None or p.step_s < best[0] * (1 - MARGIN) else best

    def _scan(self, mb: int, depth: int, bufs: int, sched: str, chunk: int, cfg: StepConfig, best: _B) -> _B:
        for pol in self._policies(mb, depth, bufs, sched, chunk, cfg):
            best = self._try(self.plan(mb, pol, depth, bufs, sched, chunk), cfg, best)
        return best

    def _policies(
        self, mb: int, depth: int, bufs: int, sched: str, chunk: int, cfg: StepConfig
    ) -> Iterator[tuple[str, ...]]:
        """The distinct activation policies of the scan's grid (n layers saved, the rest recomputed) that fit."""
        seen = set()
        for n in [0] if self.r.activations else self.grid:
            pol = self.assign(mb, n, depth, bufs, sched, chunk, cfg)
            if pol is not None and pol not in seen:
                seen.add(pol)
                yield pol

    # ------------------------------------------------------------------ errors
    def _check_static(self, sched: str) -> None:
        m, cb = self.own, self.cb  # one rank's shards
        spp = 0 if self.r.lora_base else self.spp
        store = int(2 * sum((cb + (0 if b.frozen else spp)) * b.numel + cb * b.frozen_numel for b in m.blocks))
        if self.b.ssd_bytes and store > self.b.ssd_bytes:
            raise InfeasibleError(
                f"SSD space: the store needs {fs(store)} (two versions of {cb + spp} B/param × "
                f"{m.params / 1e9:.2f} B params{' in this rank' + chr(39) + 's shards' if self.r.cluster.world > 1 else ''}), "
                f"{fs(self.b.ssd_bytes)} is free; add --ssd "
                f"directories or use --optimizer-state int8 (fewest bytes; lossy: see the README)"
            )
        need = host_buffers(
            m,
            Plan(
                prefetch_depth=1, schedule=sched, park_ram_blocks=0, state_chunk=MIN_CHUNK, lora_base=self.r.lora_base
            ),
            self.cfg(1),
        )
        if need > self.b.cpu_memory:
            big = max(b.numel for b in m.blocks)
            park = "; clipping's parked gradients already on SSD" if sched == "overlap_next_forward" else ""
            raise BlockTooLargeError(
                f"host memory: the smallest buffer set needs {fs(need, up=True)} (2 weight + 2 gradient + 2 new-weight buffers "
                f"of the largest block, {fs(cb * big)} each, + 2 state chunks of 1 Mi params{park}); --cpu-memory is "
                f"{fs(self.b.cpu_memory)}. Raise --cpu-memory to ≥ {fs(need, up=True)}"
            )

    def _fewer_tokens(self, seqs: int, room: int, per_tok: int) -> str:
        """What to lower so the step fits: the step's tokens (all ranks') to ``seqs`` sequences
        (``_seqs_fitting``), or, when not even one fits, the sequence length (one sequence's block
        inputs, ``per_tok`` bytes per token, fit ``room`` bytes)."""
        if seqs == 0:
            fit = max(0, room) // per_tok
            return f"Lower --seq-len (one sequence's inputs fit up to {fit} tokens)"
        return f"Lower --tokens-per-step to ≤ {seqs * self.r.seq_len * self.r.cluster.world} (or --seq-len)"

    def _at(self, plan: Plan, cfg: StepConfig, seqs: int) -> Memory:
        """Memory of ``plan`` over ``seqs`` sequences of ``cfg``'s micro-batches (the accumulation follows)."""
        return self.memory(dataclasses.replace(plan, grad_accum=max(1, seqs // cfg.micro_batch_size)), cfg)

    def _seqs_fitting(self, plan: Plan, cfg: StepConfig, host: bool) -> int:
        """The most sequences (a multiple of the micro-batch, at most the step's) whose step fits the
        device budget, and with ``host`` the host budget too; 0 if not even one micro-batch does. The
        device peak grows with the step's tokens (kept inputs, every micro-batch's hidden states)."""
        mb = cfg.micro_batch_size

        def ok(k: int) -> bool:
            m = self._at(plan, cfg, k * mb)
            return m.device <= self.b.gpu_memory and (not host or m.host <= self.b.cpu_memory)

        lo, hi = 0, self.seqs // mb
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
        return lo * mb

    def _device_error(self, mb: int, depth: int, bufs: int, sched: str, chunk: int) -> NoReturn:
        pol = tuple(self.base_policies())
        plan, cfg = self.plan(mb, pol, depth, bufs, sched, chunk), self.cfg(mb)
        mem = self.memory(plan, cfg)
        holders = set(self.m.route_holders())
        kept = sum(
            (blk.keeps_input or b in holders) and blk.kind != "head" for b, blk in enumerate(self.m.blocks[: self.H])
        )
        per_tok = kept * self.m.hidden * self.cb
        inputs = per_tok * self.seqs * self.r.seq_len
        boundary = 0 if self.rc == "recompute_cpu" else inputs
        work = self._at(plan, cfg, mb).device - (
            0 if not boundary else per_tok * mb * self.r.seq_len
        )  # one micro-batch's
        rank = " per rank" if self.r.cluster.world > 1 else ""
        fewer = self._fewer_tokens(self._seqs_fitting(plan, cfg, host=False), self.b.gpu_memory - work, per_tok)
        msg = (
            f"device memory: block inputs kept for backward need {fs(boundary)} ({kept} blocks × "
            f"{self.seqs * self.r.seq_len} tokens{rank} × {self.m.hidden} × {self.cb} B) plus a working set of "
            f"{fs(mem.device - boundary)} at micro-batch {mb}; --gpu-memory is {fs(self.b.gpu_memory)}. {fewer}"
            f", or raise --gpu-memory to ≥ {fs(mem.device, up=True)}"
        )
        big = max(self.m.blocks, key=lambda b: 2 * b.numel + b.frozen_numel)
        alone = (2 * big.numel + big.frozen_numel) * self.cb  # its weights and its trained part's gradient
        if work > self.b.gpu_memory and alone >= self.b.gpu_memory:
            kinds = {
                "embed": "the embedding",
                "head": "the LM head",
                "experts": "an expert group",
                "layer": "a decoder layer",
            }
            grouped = self.m.expert_groups > 1 and big.kind in ("layer", "experts")
            split = f" ({kinds.get(big.kind, big.kind)}" + (
                f", its layer's experts in {self.m.expert_groups} groups)" if grouped else ")"
            )
            raise BlockTooLargeError(
                f"device memory: block {big.name}{split} ({(big.numel + big.frozen_numel) / 1e9:.2f} B params) needs "
                f"{fs(alone)} on the device for its weights and gradients alone, whatever the "
                f"sequence length; --gpu-memory is {fs(self.b.gpu_memory)}. Raise --gpu-memory to ≥ {fs(work, up=True)}"
            )
        if work > self.b.gpu_memory:
            shape = f"{mb} × {self.r.seq_len}" if mb > 1 else f"{self.r.seq_len}"
            lower = "Lower --micro-batch-size or --seq-len" if mb > 1 else "Lower --seq-len"
            raise InfeasibleError(
                f"device memory: one micro-batch of {shape} tokens needs a working set of "
                f"{fs(work)} (weights, gradients, activations of one block, logits); --gpu-memory is "
                f"{fs(self.b.gpu_memory)}. {lower}, or raise --gpu-memory"
            )
        if not boundary:  # the device holds the working set: host RAM cannot hold the inputs
            raise InfeasibleError(
                f"host memory: with block inputs in host RAM (recompute_cpu, {fs(inputs)}) the host needs "
                f"{fs(mem.host)}; --cpu-memory is {fs(self.b.cpu_memory)}. Raise --cpu-memory to ≥ {fs(mem.host, up=True)}, "
                f"or {self._fewer_tokens(self._seqs_fitting(plan, cfg, host=True), self.b.cpu_memory - (mem.host - inputs), per_tok).lower()}"
            )
        raise InfeasibleError(msg)

    # ------------------------------------------------------------------ result
    def _result(self, best: _Best) -> PlannerResult:
        if self.r.ram_tiers:
            best = self._with_ram_tiers(best)
        _, plan, cfg, pred = best
        return PlannerResult(self.m.name, self.hw.name, plan, cfg, pred, self.b, self.evals)

    def _with_ram_tiers(self, best: _Best) -> _Best:
        """RAM tiers on the best plan and on each of its activation alternatives (the scan's grid at the same
        micro-batch, buffers and schedule): where the SSD binds, plans tie before the tiers, and one that
        leaves more host RAM spare can end faster once the tier fills it (more memory must never predict a
        slower step). The fastest found if ≥ 1 % faster than ``best``, else ``best``."""
        _, plan, cfg, pred = best
        out = self._ram_tiers(plan, cfg, pred)
        knobs = (plan.prefetch_depth, plan.state_buffers, plan.schedule, plan.state_chunk)
        for pol in self._policies(cfg.micro_batch_size, *knobs, cfg):
            if pol == plan.activation_policy:
                continue
            cand = self._ram_tiers(dataclasses.replace(plan, activation_policy=pol), cfg, pred)
            if cand is not None and (out is None or cand[0] < out[0] * (1 - MARGIN)):
                out = cand
        return out or best

    def _ram_tiers(self, plan: Plan, cfg: StepConfig, pred: Prediction) -> _Best | None:
        """The plan with the first blocks' weights (then state) in RAM, as many as fit the host budget,
        under each allowed schedule (with ``overlap_backward`` RAM-tier updates wait for the step's
        finiteness, so ``overlap_next_forward`` often suits a RAM tier better); the fastest if
        predicted ≥ 1 % faster than ``pred``, else None."""
        best: _Best | None = None
        for sched in self._schedules():
            cand = self._ram_tiers_for(dataclasses.replace(plan, schedule=sched), cfg)
            if cand is not None and (best is None or cand[0] < best[0]):
                best = cand
        return best if best is not None and best[0] < pred.step_s * 0.99 else None

    def _ram_tiers_for(self, plan: Plan, cfg: StepConfig) -> _Best | None:
        if not self.fits(plan, cfg):
            return None
        spare = self.b.cpu_memory - self.memory(plan, cfg).host
        w = s = 0
        for blk in self.own.blocks:
            if self.cb * (blk.numel + blk.frozen_numel) > spare:
                break
            spare -= self.cb * (blk.numel + blk.frozen_numel)
            w += 1
        for blk in self.own.blocks if w == len(self.own.blocks) and not self.r.lora_base else ():
            state = self.fmt.block_bytes(blk.numel, plan.state_chunk, self.cb)
            if state > spare:
                break
            spare -= state
            s += 1
        alt = dataclasses.replace(plan, ram_weight_blocks=w, ram_state_blocks=s)
        while (w or s) and not self.fits(alt, cfg):  # 4 KiB rounding and parked gradients: shrink
            s, w = (s - 1, w) if s else (0, w - 1)
            alt = dataclasses.replace(plan, ram_weight_blocks=w, ram_state_blocks=s)
        if not w:
            return None
        p = self.score(alt, cfg)
        best: _Best = (p.step_s, alt, cfg, p)
        while w > 1:  # fewer RAM-tier blocks can be faster (overlap_backward holds their updates back)
            w //= 2
            best = self._try(dataclasses.replace(plan, ram_weight_blocks=w, ram_state_blocks=0), cfg, best)
        return best


def _device_bound(res: PlannerResult) -> bool:
    """Whether device memory shaped ``res``: some layer recomputes (its input on the device or in host
    RAM), or the micro-batch is smaller than the step's sequences. Otherwise block inputs in host RAM
    cannot buy anything (every layer keeps its activations at the largest micro-batch) and the second
    search is skipped, as are finer expert groups (``_finer``)."""
    seqs = res.plan.grad_accum * res.step.micro_batch_size
    return any(p in RECOMPUTES for p in res.plan.activation_policy) or res.step.micro_batch_size < seqs


def search(shape: ModelShape, prof: HardwareProfile, budgets: Budgets, req: Request = Request()) -> PlannerResult:
    """The fastest predicted plan for ``shape`` on ``prof`` within ``budgets``. A mixture of experts
    whose layers do not fit whole (``BlockTooLargeError``, or a device working set too large) is
    planned with its layers split into the fewest expert groups
    (``fuyou.schedule.experts.expert_group_options``) that fit: ``Plan.expert_groups``; where device
    memory shapes that plan, into more groups while each is predicted ≥ 1 % faster (``_finer``); in
    either walk, no finer than the first count whose groups set no memory floor (``_experts_bind``). A
    model whose embedding or untied head sets a host floor above the budget is planned with them split
    by vocabulary rows (``_vocab_split``: ``Plan.vocab_groups``).

    Raises InfeasibleError naming the binding budget (device memory, host memory or SSD space) with
    the numbers and what to change; ConfigError for inconsistent fixed choices.
    """
    if req.seq_len < 1 or req.tokens_per_step < 1:
        raise ConfigError(f"--seq-len and --tokens-per-step must be ≥ 1, got {req.seq_len} and {req.tokens_per_step}")
    state_format(req.optimizer_state, resumable=True)  # raises ConfigError naming the choices
    try:
        return _search_groups(shape, prof, budgets, req)
    except BlockTooLargeError as e:
        split = _vocab_split(shape)
        if split is None or not str(e).startswith("host memory"):
            raise
        return _search_groups(split, prof, budgets, req)


def _vocab_split(shape: ModelShape) -> ModelShape | None:
    """``shape`` with its embedding and LM head split by vocabulary rows into the fewest groups that bring
    each within a decoder layer (``fuyou.schedule.vocab.bounding_groups``), or None where they are no
    larger than one already, or cannot be split (tied, GPT-2, split already)."""
    layer = max((b.numel for b in shape.blocks if b.kind == "layer"), default=0)
    big = max(b.numel for b in shape.blocks if b.kind in ("embed", "head"))
    if shape.vocab_groups > 1 or big <= layer:
        return None
    try:
        return shape.split_vocab(bounding_groups(shape.vocab, shape.hidden, layer))
    except ConfigError:
        return None


def _search_groups(shape: ModelShape, prof: HardwareProfile, budgets: Budgets, req: Request) -> PlannerResult:
    """``search`` over the expert-group counts of ``shape`` (its docstring)."""
    options = [g for g in expert_group_options(shape.experts) if g >= shape.expert_groups] if shape.experts else [1]
    last: InfeasibleError | None = None
    for i, g in enumerate(options):
        try:
            split = shape.split(g) if shape.experts else shape
        except ConfigError:  # the family's layers do not split (Llama 4's experts run whole)
            break
        try:
            res = _search_split(split, prof, budgets, req)
        except InfeasibleError as e:
            last = e
            if not (isinstance(e, BlockTooLargeError) or str(e).startswith("device memory")):
                raise
            if not _experts_bind(split, prof, budgets, req, smallest=True):
                break  # no finer split needs less memory than this one
            continue
        return _finer(res, shape, options[i + 1 :], prof, budgets, req)
    assert last is not None  # one option at least was tried
    raise last


def _experts_bind(shape: ModelShape, prof: HardwareProfile, budgets: Budgets, req: Request, smallest: bool) -> bool:
    """Whether splitting ``shape``'s layers into more expert groups than it has could lower a memory
    floor: the largest block (the host's weight, gradient and state buffers are sized to it) is an
    expert group, or the device peak of the plan with every layer recomputed (inputs on the device,
    or in host RAM) falls in an expert group's phase at the smallest micro-batch size searched
    (``smallest``: the least device memory any plan needs) or at any (otherwise). True for a model not
    split yet (its layers hold their experts whole).

    Sound because from two groups on nothing but the expert groups changes with their count: each split
    layer keeps one route whatever its groups (``ModelShape.route_holders``), its core and the other
    blocks stay as they are, and an expert group's weights, gradients and transients only shrink as it
    holds fewer experts. Where this is False, a finer split needs as much memory as this one at those
    micro-batch sizes: ``_search_groups`` stops at a count that did not fit, ``_finer`` at a plan
    more groups cannot give more room. Comparing the blocks' sizes alone would not do: an expert
    group's transients per token exceed a decoder layer's core's, so its phase can set the device peak
    while it is smaller than the LM head (GLM-4.5 at 22 GiB, 8 groups, inputs in host RAM, micro-batch 1:
    5.65 GiB against the head's 5.39)."""
    if shape.expert_groups == 1:
        return True
    own = shape.sharded(req.cluster.world).blocks
    groups, others = [b for b in own if b.kind == "experts"], [b for b in own if b.kind != "experts"]
    for size in (lambda b: b.numel, lambda b: b.numel + b.frozen_numel):  # gradient and state; weights read
        if max(map(size, groups), default=0) > max(map(size, others)):
            return True
    for offload in (False, True):
        s = _Search(shape, prof, budgets, req, offload)
        mbs = s.micro_batches()
        if s.experts_set_peak(mbs[-1:] if smallest else mbs):
            return True
    return False


def _finer(
    res: PlannerResult, shape: ModelShape, finer: list[int], prof: HardwareProfile, budgets: Budgets, req: Request
) -> PlannerResult:
    """``res``, or a plan with the layers in more expert groups while each is predicted ≥ 1 % faster:
    where device memory shaped the plan (``_device_bound``), smaller blocks leave room for larger
    micro-batches or saved activations — as long as the expert groups set a device peak or the
    buffers' size at some micro-batch size (``_experts_bind``)."""
    split = shape.split(res.plan.expert_groups)
    for g in finer:
        if not _device_bound(res) or not _experts_bind(split, prof, budgets, req, smallest=False):
            break
        try:
            split = shape.split(g)
            alt = _search_split(split, prof, budgets, req)
        except (InfeasibleError, ConfigError):
            break
        if alt.prediction.step_s >= res.prediction.step_s * 0.99:
            break
        res = dataclasses.replace(alt, considered=res.considered + alt.considered)
    return res


def _search_split(shape: ModelShape, prof: HardwareProfile, budgets: Budgets, req: Request) -> PlannerResult:
    """``search`` for ``shape`` as it is split."""
    try:
        main = _Search(shape, prof, budgets, req, offload=False).run()
    except InfeasibleError as device_bound:
        try:
            return _Search(shape, prof, budgets, req, offload=True).run()
        except InfeasibleError as e:
            if str(e).startswith("host memory: with block inputs"):
                raise InfeasibleError(f"{device_bound}; or, {e}") from None
            raise
    if not _device_bound(main):
        return main
    try:
        alt = _Search(shape, prof, budgets, req, offload=True).run()
    except InfeasibleError:
        return main
    considered = main.considered + alt.considered
    return dataclasses.replace(
        alt if alt.prediction.step_s < main.prediction.step_s * 0.99 else main, considered=considered
    )
