"""The cost model: (model shape, Plan, StepConfig, profile) → step time, busy time per resource,
memory per tier, SSD traffic and wear. Pure Python, no torch.

Step time comes from simulating the step's operations with their dependencies (``graph.py``), not
from a sum or a max. Memory per tier:

* device — the step's peak by the device-memory model the engine admits steps with
  (``fuyou.schedule.device_memory``: phase by phase, per activation policy; ``device_peak``);
* host — the engine's buffer pool and RAM tier, counted by the rules the engine reserves them with
  (``fuyou.schedule.sizing``), ``swap_cpu`` activations and ``recompute_cpu`` block inputs (all
  alive at the turnaround) and transient ``swap_ssd`` staging;
* SSD — two versions of the store (crash-safe commits) plus scratch files: ``swap_ssd`` activations and
  gradients parked on SSD (``fuyou.transfer.grad_park``).

With several data-parallel ranks (``StepConfig.cluster``) every figure is one rank's: host buffers,
the RAM tier, the store and SSD traffic are its shards' (``ModelShape.sharded``), the device holds
whole gathered blocks plus the reduce-scattered gradient shard, and tokens (so tokens/s and TFLOPS)
are the whole step's, all ranks together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from fuyou.planner.graph import StepConfig, StepGraph, simulate
from fuyou.planner.profile import HardwareProfile
from fuyou.schedule import device_memory, rules, sizing
from fuyou.schedule.device_memory import DevicePeak
from fuyou.schedule.plan import Plan
from fuyou.schedule.shapes import BlockShape, ModelShape

DAY_S = 86400.0
ADAPTER_STAGED_BYTES_PER_PARAM = 12
"""A LoRA adapter parameter in its host staging buffer (checkpoints, resume): fp32 weight, m and v."""
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
"""Busy kinds of the ``comm`` resource (``graph.StepGraph._collective``)."""
FLOP_FORMULA = (
    "model FLOPs = tokens × (6·N_matmul + 3·Σ attention, 12·L·d·T for multi-head attention), "
    "4·N_matmul for LoRA's frozen base; recompute not counted "
    "(ModelShape.train_flops_per_token)"
)


@dataclass(frozen=True)
class Memory:
    """Peak bytes per tier."""

    device: int
    host_buffers: int
    """The engine's pre-reserved host buffers (pinned on CUDA)."""
    host_activations: int
    """``swap_cpu`` activations at the turnaround plus ``swap_ssd`` staging in flight."""
    host_ram_tiers: int = 0
    """Weights/state kept in host RAM instead of on SSD (``fuyou.transfer.ram_tier``)."""
    ssd: int = 0
    """Store (two versions) plus activation and parked-gradient scratch files."""
    device_phase: str = ""
    """The step's phase the device peak falls in (``fuyou.schedule.device_memory``)."""
    device_by_kind: dict[str, int] = field(default_factory=dict)
    """Block kind (embed, layer, experts, head) → the largest device peak of its phases."""

    @property
    def host(self) -> int:
        """Everything counted against ``--cpu-memory``."""
        return self.host_buffers + self.host_activations + self.host_ram_tiers


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for one steady-state step (seconds, bytes, FLOP/s)."""

    step_s: float
    busy_s: dict[str, float]
    """Busy seconds per resource kind: ssd_read, ssd_write, h2d, d2h, compute, adam, thread."""
    bottleneck: str
    tokens: int
    tokens_per_s: float
    model_flops: float
    """Model FLOPs per step (``FLOP_FORMULA``)."""
    tflops: float
    mfu: float
    """tflops ÷ the profile's device peak (0 if unknown)."""
    memory: Memory
    ssd_read_bytes: int
    ssd_write_bytes: int
    dwpd: float
    """Drive writes per day at this step rate (store capacity ÷ bytes written per day)."""
    comm_bytes: int = 0
    """Bytes one rank's collectives move per step (all-gathers in, reduce-scatters out)."""
    flop_formula: str = FLOP_FORMULA
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """Plain data."""
        d = asdict(self)
        d["memory"]["host"] = self.memory.host
        return d


def footprint(shape: ModelShape, cfg: StepConfig) -> sizing.Footprint:
    """One rank's host-memory footprint at ``cfg``'s element sizes (its shards of every block), with
    LoRA the adapters' staging buffer (fp32 weight, m and v: ``ADAPTER_STAGED_BYTES_PER_PARAM``)."""
    fp = shape.sharded(cfg.cluster.world).footprint(cfg.compute_bytes, cfg.state_format)
    return dataclasses.replace(fp, adapter_bytes=ADAPTER_STAGED_BYTES_PER_PARAM * cfg.adapter_params)


def host_buffers(shape: ModelShape, plan: Plan, cfg: StepConfig) -> int:
    """Bytes of the host buffers the engine reserves for ``plan`` besides the RAM tier, parked
    gradients included (``sizing.buffer_classes``)."""
    return sizing.host_buffer_bytes(footprint(shape, cfg), plan)


def ram_tier_bytes(shape: ModelShape, plan: Plan, cfg: StepConfig) -> int:
    """Host bytes of ``plan``'s RAM tier (``sizing.ram_tier_bytes``)."""
    return sizing.ram_tier_bytes(footprint(shape, cfg), plan)


def device_peak(shape: ModelShape, plan: Plan, cfg: StepConfig, device: str = "cpu") -> DevicePeak:
    """The step's device peak (``fuyou.schedule.device_memory``) on a ``device`` backend: the blocks
    at ``cfg``'s element size and sequence length, LoRA adapters (fp32 weights, gradients, m and v:
    ``device_memory.ADAPTER_BYTES_PER_PARAM``), the reduce-scattered gradient shard with several ranks, the
    family's persistent buffers, and what the backend's libraries take (``sizing.library_bytes``)."""
    cb, world = cfg.compute_bytes, cfg.cluster.world
    shard_grad = cb * max(blk.numel for blk in shape.sharded(world).blocks) if world > 1 else 0
    run = device_memory.step_run(
        cfg.micro_batch_size, cfg.seq_len, plan.grad_accum, shape.hidden, cb, shape.vocab,
        adapter_params=cfg.adapter_params, shard_grad_bytes=shard_grad, device=device, device_bytes=cfg.device_memory,
        held_bytes=shape.held_bytes(cb),
    )  # fmt: skip
    pol = device_memory.block_policies(plan, len(shape.blocks))
    return device_memory.device_peak(
        shape.device_blocks(cb, cfg.seq_len, cfg.micro_batch_size, world, plan.lora_base), pol, run
    )


def memory(shape: ModelShape, plan: Plan, cfg: StepConfig, prof: HardwareProfile) -> Memory:
    """Peak bytes per tier (see the module docstring)."""
    g = StepGraph(shape, plan, cfg, prof)
    H, K, mbt = g.F, g.K, g.mb_tokens  # the blocks before the head (its first group)
    T = K * mbt
    pol = [g._policy(b) for b in range(H)]
    cb = cfg.compute_bytes
    kept = [blk.keeps_input or b in g.route_holders for b, blk in enumerate(shape.blocks[:H])]
    offloaded = sum(p == "recompute_cpu" and k for p, k in zip(pol, kept))
    peak = device_peak(shape, plan, cfg, prof.device)
    device = peak.nbytes
    own = g.own.blocks
    swap_cpu = sum(g.act_bytes(b) for b in range(H) if pol[b] == "swap_cpu")
    ssd_blocks = [b for b in range(H) if pol[b] == "swap_ssd"]
    staging = 2 * max((g.act_bytes(b) for b in ssd_blocks), default=0)
    swap_cpu += offloaded * T * shape.hidden * cb
    fmt = cfg.state_format

    def state(b: BlockShape) -> int:  # a frozen base (LoRA) stores no optimizer state, nor a block frozen whole
        if plan.lora_base or b.frozen:
            return 0
        return fmt.block_bytes(b.numel, plan.state_chunk, cb)

    store = sum(cb * (b.numel + b.frozen_numel) + state(b) for b in own)  # the read-only part: weights only
    parked = sum(cb * own[b].numel for b in rules.parked_on_ssd(len(own), g.p) if not own[b].frozen)
    return Memory(
        device=device,
        host_buffers=host_buffers(shape, plan, cfg),
        host_activations=int(swap_cpu + staging),
        host_ram_tiers=ram_tier_bytes(shape, plan, cfg),
        ssd=int(2 * store + parked + sum(g.act_bytes(b) for b in ssd_blocks)),
        device_phase=peak.phase,
        device_by_kind=peak.by_kind,
    )


def predict(shape: ModelShape, plan: Plan, cfg: StepConfig, prof: HardwareProfile) -> Prediction:
    """Predict one steady-state step of ``plan`` (an engine ``Plan``) under ``cfg`` on ``prof``; with
    several ranks, per rank (tokens: all ranks')."""
    step_s, busy, comm_bytes = simulate(shape, plan, cfg, prof)
    busy = {k: v for k, v in busy.items() if k != "sync"}
    tokens = plan.grad_accum * cfg.micro_batch_size * cfg.seq_len * cfg.cluster.world
    flops = float(tokens * shape.train_flops_per_token(cfg.seq_len, plan.lora_base))
    rb = round(busy.get("ssd_read", 0.0) * prof.ssd_read_Bps)
    wb = round(busy.get("ssd_write", 0.0) * prof.ssd_write_Bps)
    view = dict(busy)
    if prof.device == "cpu":  # compute, copies, collectives and Adam share the cores: one resource
        view = {
            "ssd": busy.get("ssd_read", 0.0) + busy.get("ssd_write", 0.0),
            "cpu": sum(v for k, v in busy.items() if k not in ("ssd_read", "ssd_write")),
        }
    else:
        view["ssd"] = view.pop("ssd_read", 0.0) + view.pop("ssd_write", 0.0)
        comm = sum(view.pop(k, 0.0) for k in COLLECTIVES)
        if comm:
            view["comm"] = comm
    bottleneck = max(view, key=view.__getitem__)
    tflops = flops / step_s / 1e12
    dwpd = wb * (DAY_S / step_s) / prof.ssd_capacity_bytes
    return Prediction(
        step_s=step_s,
        busy_s=busy,
        bottleneck=bottleneck,
        tokens=tokens,
        tokens_per_s=tokens / step_s,
        model_flops=flops,
        tflops=tflops,
        mfu=tflops * 1e12 / (prof.device_peak_flops * cfg.cluster.world) if prof.device_peak_flops else 0.0,
        memory=memory(shape, plan, cfg, prof),
        ssd_read_bytes=rb,
        ssd_write_bytes=wb,
        dwpd=dwpd,
        comm_bytes=round(comm_bytes),
        extra={"resource_busy_s": view},
    )
