"""The Plan: everything that decides how a step runs, as frozen plain data — the contract between
whoever decides (the cost-model planner, or the budget rules in ``fuyou.schedule.sizing``) and the
engine that executes it. No torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fuyou.errors import ConfigError

POLICIES = ("keep", "swap_cpu", "swap_ssd", "recompute", "recompute_cpu")
RECOMPUTES = ("recompute", "recompute_cpu")
"""Policies that keep only the block input and re-run the forward in backward."""
SCHEDULES = ("overlap_backward", "overlap_next_forward")
AUTO = "auto"
"""``Plan.schedule`` default: ``overlap_next_forward`` with clipping, else ``overlap_backward``
(``fuyou.schedule.rules.resolve``)."""
MIN_CHUNK = 1 << 20
DEFAULT_MAX_GRAD_NORM = 1.0
"""Global-norm clipping threshold of ``fuyou finetune`` and ``fuyou plan`` when none is given (clipping
chooses the schedule: ``AUTO``)."""
"""Smallest state chunk the budget rules shrink to (elements)."""


@dataclass(frozen=True)
class Plan:
    """How one training step runs.

    ``activation_policy`` has one entry per block (embed, layers…, head): ``keep`` the autograd
    graph on the device, ``swap_cpu`` its saved tensors to host memory, ``swap_ssd`` on to the SSD,
    ``recompute`` (keep only the block input, re-run the forward in backward), or ``recompute_cpu``
    (the same with the block input in host memory). The head's activations never outlive the
    turnaround, so its entry is ignored.
    """

    grad_accum: int = 1
    """Micro-batches per step (K, ``--grad-accum``); they go through each block together (layer-grouped
    accumulation)."""
    prefetch_depth: int = 2
    """Blocks of weights read ahead of the one being computed (≥ 1)."""
    activation_policy: tuple[str, ...] = ()
    """Per-block policy; empty means ``recompute`` for every layer (``keep`` for embed)."""
    schedule: str = AUTO
    """``overlap_backward``: Adam(i) during backward of i−1 (no global clipping); ``overlap_next_forward``:
    exact clipping and non-finite skipping, Adam(i) overlapped with the next step's forward; ``auto``:
    the latter with clipping, else the former (resolved by the engine: ``rules.resolve``)."""
    state_buffers: int = 2
    """Host buffers for optimizer state in flight (≥ 2: read of the next overlaps the current update)."""
    ram_weight_blocks: int = 0
    """Blocks 0…N−1 (layout order) whose compute weights live in host RAM instead of on SSD: reads are
    memcpys, and per-step commits do not write them (``fuyou.transfer.ram_tier``). ≤ the block count."""
    ram_state_blocks: int = 0
    """Blocks 0…M−1 whose fp32 master + m + v live in host RAM instead of on SSD. ≤ the block count."""
    park_ram_blocks: int | None = None
    """Where parked gradients wait (the clipping schedule parks every block's until backward ends;
    ``overlap_backward`` with a RAM tier parks blocks 1…R−1's): blocks 0…N−1 in host RAM, later blocks
    on SSD (written as backward finishes them, read back by the Adam pass: ``fuyou.transfer.grad_park``).
    None: every block in RAM."""
    lora_base: bool = False
    """The streamed model is a LoRA run's frozen base (``fuyou.engine.lora``): no block trains, weights
    are only read; no gradient leaves the device, and there is no optimizer state, Adam or write."""
    expert_groups: int = 0
    """Expert-group blocks each mixture-of-experts layer is split into after its core block (1: a
    layer is one block; ``fuyou.models.blocks.split_experts``), so a layer whose experts do not fit
    the device streams in parts. 0: the fewest whose largest block fits the device budget
    (``fuyou.engine.assembly.expert_groups_for``). A resumed store keeps its own."""
    vocab_groups: int = 0
    """Blocks the embedding and the LM head are each split into by vocabulary rows (1: one block each;
    ``fuyou.schedule.vocab``), so a large vocabulary does not size every host weight buffer. Not with
    tied embeddings. 0: as needed — one, unless the host budget cannot hold the smallest buffer set of
    the unsplit model, then the fewest that bring each within a decoder layer
    (``fuyou.engine.assembly.vocab_groups_for``). A resumed store keeps its own."""
    state_chunk: int = 1 << 23
    """Elements per optimizer-state chunk, a multiple of 32 (8 Mi: 96 MiB of fp32 master + m + v):
    host memory for state is ``state_buffers`` × one chunk, whatever the largest block. A resumed
    store keeps the chunk it was created with."""

    def __post_init__(self) -> None:
        problems = []
        if self.grad_accum < 1:
            problems.append(f"--grad-accum must be ≥ 1, got {self.grad_accum}")
        if self.prefetch_depth < 1:
            problems.append(f"prefetch depth must be ≥ 1, got {self.prefetch_depth}")
        if self.schedule not in SCHEDULES + (AUTO,):
            problems.append(f"schedule must be one of {SCHEDULES + (AUTO,)}, got {self.schedule!r}")
        if self.state_chunk <= 0 or self.state_chunk % 32:
            problems.append(f"state chunk must be a positive multiple of 32 elements, got {self.state_chunk}")
        if self.state_buffers < 2:
            problems.append(f"state buffers must be ≥ 2, got {self.state_buffers}")
        for name in ("ram_weight_blocks", "ram_state_blocks"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be ≥ 0, got {getattr(self, name)}")
        if self.lora_base and self.ram_state_blocks:
            problems.append("a LoRA base has no optimizer state to keep in RAM (ram_state_blocks must be 0)")
        if self.expert_groups < 0:
            problems.append(f"expert_groups must be ≥ 0 (0: as needed), got {self.expert_groups}")
        if self.vocab_groups < 0:
            problems.append(f"vocab_groups must be ≥ 0 (0: as needed), got {self.vocab_groups}")
        if self.park_ram_blocks is not None and self.park_ram_blocks < 0:
            problems.append(f"park_ram_blocks must be ≥ 0 or None, got {self.park_ram_blocks}")
        bad = [p for p in self.activation_policy if p not in POLICIES]
        if bad:
            problems.append(f"activation policies must be in {POLICIES}, got {bad}")
        if problems:
            raise ConfigError("invalid plan: " + "; ".join(problems))

    def policy(self, block: int, nblocks: int) -> str:
        """The activation policy of ``block``."""
        if self.activation_policy:
            if len(self.activation_policy) != nblocks:
                raise ConfigError(f"plan has {len(self.activation_policy)} activation policies for {nblocks} blocks")
            return self.activation_policy[block]
        return "keep" if block == 0 else "recompute"

    def parks_in_ram(self, block: int) -> bool:
        """Whether ``block``'s parked gradient waits in host RAM (else on SSD)."""
        return self.park_ram_blocks is None or block < self.park_ram_blocks

    @property
    def clips(self) -> bool:
        """Whether this (resolved) plan runs the clipping schedule, which parks every gradient."""
        return self.schedule == "overlap_next_forward"

    def to_json(self) -> dict:
        """Plain data (for logs and the planner)."""
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> Plan:
        """The plan ``to_json`` wrote (JSON turns the policy tuple into a list). Raises TypeError for a
        field this version does not know."""
        d = {**d, "activation_policy": tuple(d.get("activation_policy", ()))}
        if "frozen" in d:  # its name in the runs recorded before it was renamed (run.json, planner JSON)
            d["lora_base"] = d.pop("frozen")
        return Plan(**d)
