"""FinetuneConfig: every ``fuyou finetune`` setting, validated at once; YAML files mirror the flags."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from fuyou.data.sources import parse_columns
from fuyou.engine.balance import MODES as BALANCE_MODES
from fuyou.errors import ConfigError
from fuyou.models.lora import LoraSettings
from fuyou.run import reporters
from fuyou.run.lr import SCHEDULES
from fuyou.schedule.plan import DEFAULT_MAX_GRAD_NORM, POLICIES
from fuyou.schedule.state_format import CHOICES, FORMATS
from fuyou.units import parse_size

DEFAULT_SAVE_EVERY = "30min"
"""Checkpoint every 30 minutes of wall time by default: at most half an hour of training lost to a
crash or preemption, for a stall of milliseconds (hard links) and at most one pinned version of the
state per kept checkpoint on the SSD."""


@dataclass(frozen=True)
class FinetuneConfig:
    """Settings of one fine-tuning run; the names are the CLI flags with ``-`` → ``_``."""

    model: str | None = None
    """Hugging Face model directory or hub id ``ORG/NAME[@REVISION]`` (``fuyou.models.hub``); None: the demo model."""
    data: str | tuple[str, ...] | None = None
    """Training data (``--data``, repeatable): JSONL or Parquet files, globs, ``datasets`` directories, hub dataset
    ids (``fuyou.data.sources``), kept as a tuple; None: the built-in demo text."""
    columns: str | dict[str, str] | None = None
    """Field names of the data as Fuyou's: ``prompt=instruction,completion=output`` (or a mapping in YAML)."""
    output: str = "fuyou-run"
    """Run directory: model/, metrics.jsonl, run.json."""
    ssd: tuple[str, ...] = ()
    """Store directories (one per SSD); empty: OUTPUT/store."""
    cpu_memory: str | int = "2GiB"
    gpu_memory: str | int | None = None
    device: str = "auto"
    seq_len: int = 256
    micro_batch_size: int = 1
    grad_accum: int = 1
    steps: int | None = None
    epochs: float | None = None
    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    max_grad_norm: float = DEFAULT_MAX_GRAD_NORM
    precision: str = "auto"
    """``auto`` (bf16 where the device computes it fast, else fp32: ``fuyou.device.precision``), ``bf16`` or ``fp32``."""
    optimizer_state: str = "auto"
    """How AdamW's state is stored (``fuyou.schedule.state_format``): ``fp32``, ``split`` (identical updates,
    fewer bytes), ``bf16`` (split with bf16 moments: lossy) or ``int8`` (split with 8-bit block-wise moments:
    lossy, fewest bytes); ``auto``: the resumed store's, else ``split``."""
    seed: int = 0
    metrics: str | None = None
    """Per-step metrics JSONL; None: OUTPUT/metrics.jsonl."""
    trace: str | None = None
    """Perfetto trace of the last step, if set."""
    report_to: str = "none"
    """``tensorboard``: also log each step's metrics as TensorBoard scalars in OUTPUT/tensorboard
    (``fuyou.run.tensorboard``; needs the ``report`` extra); ``wandb``: to Weights & Biases
    (``fuyou.run.wandb_log``; the ``wandb`` extra); both: ``tensorboard,wandb``; ``none``: metrics.jsonl only."""
    data_format: str = "auto"
    packing: str = "auto"
    """``documents`` (each packed document attends only to itself), ``concat`` (documents run on into
    each other) or ``auto``: documents for prompt/completion and messages data, concat for text."""
    lora_rank: int | None = None
    """Train LoRA adapters of this rank on the frozen base (None: full fine-tuning)."""
    lora_alpha: int | None = None
    """LoRA scaling numerator (default: 2 × rank)."""
    lora_dropout: float = 0.0
    lora_targets: str = "all-linear"
    """Comma-separated module names the adapters wrap; ``all-linear``: every linear layer but the head."""
    merge: bool = False
    """LoRA: also write OUTPUT/model, the base with the adapters merged in."""
    freeze: tuple[str, ...] = ()
    """Parameter-name globs that do not train (``--freeze``, repeatable; ``EngineConfig.freeze``)."""
    moe_balance: str = "global"
    """A mixture of experts' balance loss: ``global`` (expert use counted over the whole step),
    ``micro`` (per micro-batch) or ``off`` (``fuyou.engine.balance``); dense models ignore it."""
    eval_fraction: float = 0.05
    """Share of the data held out for the evaluation loss (before the run, every ``eval_every`` steps, after)."""
    eval_data: str | None = None
    """A separate JSONL file (same format as ``data``) to evaluate on instead of the held-out share."""
    eval_every: int = 0
    """Evaluate the held-out loss every N steps as well (0: only before and after the run)."""
    keep_best: bool = False
    """Checkpoint at every evaluation and keep the one with the lowest held-out loss whatever
    ``keep_checkpoints`` prunes (``checkpoints/best`` names it)."""
    save_every: int | str = DEFAULT_SAVE_EVERY
    """Checkpoint every N steps (an integer) or every span of wall time (``30min``, ``2h``, ``90s``);
    0 = never. Copy-free (hard links to the committed state): each kept checkpoint pins at most one
    version of the state on the SSD."""
    keep_checkpoints: int = 2
    """Checkpoints kept (older ones are deleted; on ``--resume`` before training starts)."""
    resume: str | None = None
    """``auto`` (newest intact checkpoint, else a fresh start) or a checkpoint path."""
    overwrite: bool = False
    """Let a fresh start replace an earlier run in OUTPUT / the --ssd directories (its model, store and
    every checkpoint); without it such a start refuses."""
    progress: bool = True
    plan: str = "auto"
    """``auto``: the cost-model planner chooses the engine plan; ``rules``: the engine's simple rules."""
    profile: str | None = None
    """Hardware profile JSON for the planner (default: ~/.cache/fuyou/hw.json, else measured now)."""
    prefetch_depth: int | None = None
    """Fix the prefetch depth (blocks of weights read ahead) instead of letting the planner choose."""
    activations: str | None = None
    """Fix every layer's activation policy (keep|swap_cpu|swap_ssd|recompute|recompute_cpu) instead of planning it."""

    def __post_init__(self) -> None:
        p = []
        if isinstance(self.data, (str, list)):  # one spec, or a YAML list of them
            object.__setattr__(self, "data", (self.data,) if isinstance(self.data, str) else tuple(self.data))
        if self.data == ():
            object.__setattr__(self, "data", None)
        try:
            parse_columns(self.columns)
        except ConfigError as e:
            p.append(str(e))
        ints = {"seq_len": 2, "micro_batch_size": 1, "grad_accum": 1}
        for name, low in ints.items():
            v = getattr(self, name)
            if not isinstance(v, int) or v < low:
                p.append(f"--{name.replace('_', '-')} must be an integer ≥ {low}, got {v!r}")
        if self.steps is None and self.epochs is None:
            object.__setattr__(self, "steps", 20)
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            p.append(f"--steps must be an integer ≥ 1, got {self.steps!r}")
        if self.epochs is not None and not (self.epochs > 0):
            p.append(f"--epochs must be > 0, got {self.epochs!r}")
        if self.steps is not None and self.epochs is not None:
            p.append("give --steps or --epochs, not both")
        for name in ("lr", "weight_decay", "eps", "max_grad_norm"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                p.append(f"--{name.replace('_', '-')} must be a finite number ≥ 0, got {v!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            p.append(f"--betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.lr_schedule not in SCHEDULES:
            p.append(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            p.append(f"--warmup-steps must be an integer ≥ 0, got {self.warmup_steps!r}")
        if self.precision not in ("auto", "bf16", "fp32"):
            p.append(f"--precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.optimizer_state not in CHOICES and self.optimizer_state not in FORMATS:
            p.append(f"--optimizer-state must be one of {', '.join(CHOICES)}, got {self.optimizer_state!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            p.append(f"--device must be auto, cuda or cpu, got {self.device!r}")
        try:
            save_interval(self.save_every)
        except ConfigError as e:
            p.append(str(e))
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            p.append(f"--eval-every must be an integer ≥ 0, got {self.eval_every!r}")
        if self.keep_best and not self.eval_every:
            p.append("--keep-best needs --eval-every N (the evaluations it compares)")
        if not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints < 1:
            p.append(f"--keep-checkpoints must be an integer ≥ 1, got {self.keep_checkpoints!r}")
        if not isinstance(self.overwrite, bool):
            p.append(f"--overwrite must be true or false, got {self.overwrite!r}")
        if self.plan not in ("auto", "rules"):
            p.append(f"--plan must be auto or rules, got {self.plan!r}")
        if self.prefetch_depth is not None and (not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 1):
            p.append(f"--prefetch-depth must be an integer ≥ 1, got {self.prefetch_depth!r}")
        if self.activations is not None and self.activations not in POLICIES:
            p.append(f"--activations must be one of {', '.join(POLICIES)}, got {self.activations!r}")
        try:
            reporters.parse(self.report_to)
        except ConfigError as e:
            p.append(str(e))
        if self.packing not in ("auto", "concat", "documents"):
            p.append(f"--packing must be auto, concat or documents, got {self.packing!r}")
        if self.lora_rank is None and (self.merge or self.lora_alpha is not None):
            p.append("--merge and --lora-alpha need --lora-rank (LoRA)")
        if self.lora_rank is not None:
            try:
                self.lora  # noqa: B018 - validates the LoRA settings
            except ConfigError as e:
                p.append(str(e))
        if self.moe_balance not in BALANCE_MODES:
            p.append(f"--moe-balance must be one of {', '.join(BALANCE_MODES)}, got {self.moe_balance!r}")
        if not 0 <= self.eval_fraction < 1:
            p.append(f"--eval-fraction must be in [0, 1), got {self.eval_fraction!r}")
        for flag, v in (("--cpu-memory", self.cpu_memory), ("--gpu-memory", self.gpu_memory)):
            if v is not None:
                try:
                    parse_size(v, flag)
                except ConfigError as e:
                    p.append(str(e))
        if p:
            raise ConfigError("; ".join(p))

    @property
    def lora(self) -> LoraSettings | None:
        """The LoRA settings of the flags, or None (full fine-tuning). Raises ConfigError for bad values."""
        if self.lora_rank is None:
            return None
        alpha = self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_rank
        targets = tuple(t.strip() for t in str(self.lora_targets).split(",") if t.strip())
        return LoraSettings(self.lora_rank, alpha, float(self.lora_dropout), targets, self.seed)

    @property
    def store_dirs(self) -> tuple[str, ...]:
        """The SSD directories, or OUTPUT/store when none were given."""
        return self.ssd or (os.path.join(self.output, "store"),)


def save_interval(value: int | str) -> tuple[int, float]:
    """``--save-every`` as (steps, seconds): ``12`` → (12, 0); ``30min`` → (0, 1800.0); ``0`` → (0, 0),
    no checkpoints. Units: s, m/min, h. Raises ConfigError for anything else."""
    text = str(value).strip().lower()
    if isinstance(value, bool):
        text = ""
    if text.isdigit():
        return int(text), 0.0
    for unit, seconds in (("min", 60), ("s", 1), ("m", 60), ("h", 3600)):
        if text.endswith(unit):
            try:
                amount = float(text[: -len(unit)])
            except ValueError:
                break
            if amount > 0 and math.isfinite(amount):
                return 0, amount * seconds
            break
    raise ConfigError(
        f"--save-every must be a number of steps (e.g. 200), a span of wall time (e.g. 30min, 2h, 90s) "
        f"or 0 (never), got {value!r}"
    )


FIELDS = {f.name for f in dataclasses.fields(FinetuneConfig)}


def load_yaml(path: str) -> dict:
    """Read a YAML config whose keys mirror the flags (``seq-len`` or ``seq_len``).

    Raises ConfigError for a missing or unreadable file, a non-mapping, or unknown keys.
    """
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: cannot read it as YAML ({e})") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    out = {str(k).replace("-", "_"): v for k, v in doc.items()}
    unknown = sorted(set(out) - FIELDS)
    if unknown:
        raise ConfigError(f"--config {path}: unknown keys {unknown}; keys mirror the finetune flags")
    for key in ("ssd", "betas"):
        if key in out and isinstance(out[key], (list, str)):
            out[key] = tuple(out[key]) if isinstance(out[key], list) else tuple(out[key].split(","))
    if "freeze" in out:  # one glob, or a list of them
        out["freeze"] = (out["freeze"],) if isinstance(out["freeze"], str) else tuple(out["freeze"] or ())
    if isinstance(out.get("report_to"), list):  # report-to: [tensorboard, wandb]
        out["report_to"] = ",".join(str(x) for x in out["report_to"])
    if "betas" in out:
        out["betas"] = tuple(float(b) for b in out["betas"])
    return out


def merge(file_values: dict, flag_values: dict) -> FinetuneConfig:
    """Flags override the file; both override the defaults."""
    return FinetuneConfig(**{**file_values, **flag_values})
