"""EngineConfig: every setting of the training engine, validated at once, errors naming the flag."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fuyou.engine.balance import MODES as BALANCE_MODES
from fuyou.errors import ConfigError
from fuyou.models.lora import LoraSettings
from fuyou.schedule.plan import Plan
from fuyou.schedule.rules import resolve
from fuyou.schedule.state_format import CHOICES, FORMATS
from fuyou.units import parse_size

PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; sizes accept ``512MiB``/``64GiB``/``1.5GB`` strings or byte counts."""

    ssd_dirs: tuple[str, ...]
    """Store directories, one per SSD (``--ssd``)."""
    device: str = "auto"
    """``auto`` | ``cuda`` | ``cpu`` (``--device``)."""
    gpu_memory: int | str | None = None
    """Device-memory budget (``--gpu-memory``); None: the whole GPU (CPU backend: unlimited)."""
    cpu_memory: int | str = "8GiB"
    """Host budget for Fuyou's buffers: weights in flight, optimizer state, gradients (``--cpu-memory``)."""
    precision: str = "bf16"
    """Compute weights and gradients: ``bf16`` (fp32 master) or ``fp32`` (``--precision``)."""
    optimizer_state: str = "auto"
    """How AdamW's state is stored (``--optimizer-state``, ``fuyou.schedule.state_format``): ``fp32`` (an fp32
    master, m and v), ``split`` (the master as the compute weights plus a remainder: identical updates, fewer
    bytes), ``bf16`` (split, m and v in bf16: lossy), ``int8`` (split, m and v in 8 bits with a scale per 256
    elements: lossy); ``auto``: the resumed store's, else ``split``. A store keeps
    the format it was created with."""
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    no_decay: frozenset[str] = frozenset()
    """Parameter names (HF keys) without weight decay, e.g. biases and norm weights as Trainer does."""
    max_grad_norm: float = 0.0
    """Global-norm clipping threshold; 0 = off. Needs the overlap_next_forward schedule (the plan's
    default ``auto`` schedule resolves to it: ``fuyou.schedule.rules.resolve``)."""
    plan: Plan = field(default_factory=Plan)
    io: str = "auto"
    direct: str = "auto"
    checksums: bool = True
    adam_threads: int | None = None
    """numba threads for the CPU Adam (default: all cores)."""
    lora: LoraSettings | None = None
    """Train ``peft`` LoRA adapters on a frozen base (``fuyou.engine.lora``); None: full fine-tuning."""
    freeze: tuple[str, ...] = ()
    """Parameter-name globs (``fnmatch`` on Hugging Face keys, e.g. ``model.embed_tokens.*``,
    ``model.layers.[0-7].*``) that do not train (``--freeze``): no gradient leaves the device for them;
    a block frozen whole has no optimizer state and is never written."""
    moe_balance: str = "global"
    """A mixture of experts' balance loss, weighted by the config's ``router_aux_loss_coef``:
    ``global`` (expert frequencies over the whole step, every rank's), ``micro`` (per micro-batch, the
    HF model's own loss) or ``off`` (``--moe-balance``; ``fuyou.engine.balance``)."""
    batch: tuple[int, int, int] | None = None
    """The steps to come, where the caller knows them (``fuyou finetune``, FuyouTrainer): (sequences a
    micro-batch, tokens a sequence, micro-batches a step). The engine holds their device peak against
    the budget before it creates a store, so a step that cannot fit is refused with nothing written."""

    def __post_init__(self) -> None:
        problems = []
        if not self.ssd_dirs:
            problems.append("at least one --ssd directory is needed")
        if self.device not in ("auto", "cuda", "cpu"):
            problems.append(f"--device must be auto, cuda or cpu, got {self.device!r}")
        if self.precision not in PRECISIONS:
            problems.append(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.optimizer_state not in CHOICES and self.optimizer_state not in FORMATS:
            problems.append(f"--optimizer-state must be one of {', '.join(CHOICES)}, got {self.optimizer_state!r}")
        if self.freeze and self.lora is not None:
            problems.append("--freeze and --lora-rank cannot be combined: LoRA freezes the whole base already")
        if any(not isinstance(p, str) or not p for p in self.freeze):
            problems.append(f"--freeze patterns must be non-empty strings, got {list(self.freeze)}")
        if self.moe_balance not in BALANCE_MODES:
            problems.append(f"--moe-balance must be one of {', '.join(BALANCE_MODES)}, got {self.moe_balance!r}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            problems.append(f"--lr must be a finite number ≥ 0, got {self.lr}")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            problems.append(f"--max-grad-norm must be ≥ 0 (0 = off), got {self.max_grad_norm}")
        try:
            parse_size(self.cpu_memory, "--cpu-memory")
            if self.gpu_memory is not None:
                parse_size(self.gpu_memory, "--gpu-memory")
        except ConfigError as e:
            problems.append(str(e))
        if problems:
            raise ConfigError("; ".join(problems))
        resolve(self.plan, clip=self.max_grad_norm > 0)  # refuses overlap_backward with clipping, naming both

    @property
    def cpu_bytes(self) -> int:
        """Host budget in bytes."""
        return parse_size(self.cpu_memory, "--cpu-memory")

    @property
    def gpu_bytes(self) -> int | None:
        """Device budget in bytes, or None."""
        return None if self.gpu_memory is None else parse_size(self.gpu_memory, "--gpu-memory")
