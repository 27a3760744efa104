"""Drop-in Hugging Face ``Trainer`` that trains through the Fuyou engine (the only module importing Trainer).

    args = FuyouTrainingArguments(output_dir="out", ssd_dirs=["/mnt/nvme0/run"], cpu_memory="32GiB",
                                  per_device_train_batch_size=4, gradient_accumulation_steps=8, ...)
    trainer = FuyouTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    trainer.train(); trainer.save_model()

How it maps onto Trainer's loop: ``training_step`` is called once per micro-batch; Fuyou buffers
them and, on the last micro-batch of the accumulation, runs one engine step over all of them
(layer-grouped accumulation, AdamW on the CPU, state on SSD) with the learning rate the HF
scheduler set in the optimizer's ``param_groups``. ``optimizer.step()`` is then only a barrier.
Clipping (``max_grad_norm``) is exact, done by the engine; the reported grad norm is the engine's.
Supported: AdamW (``adamw_torch``, ``adamw_torch_fused``), LR schedulers, warm-up, weight decay
(biases and norm weights excluded, as Trainer does), ``max_grad_norm``, gradient accumulation,
``max_steps``, logging, evaluation loss, ``save_model`` (streamed safetensors), checkpoints
(``save_strategy``; the SSD state is checkpointed copy-free, by hard links) with ``save_total_limit``:
a copy-free checkpoint goes when Trainer rotates its ``checkpoint-N`` directory away (the newest N
stay, and the best model's when tracked), and ``resume_from_checkpoint``. A multimodal model object
(``…ForConditionalGeneration``: Gemma 3, Llama 4, Qwen3.5) trains its language model on text-only batches,
as plain Trainer does once the vision tower and projector are frozen (required); ``save_model`` then writes
the whole model with ``save_pretrained``.

The engine plan is chosen as ``fuyou finetune`` chooses it (``fuyou.run.plan_choice``, the same
chooser): by default the cost-model planner, for ``per_device_train_batch_size`` ×
``gradient_accumulation_steps`` sequences per step under ``cpu_memory``/``gpu_memory``, with clipping
when ``max_grad_norm`` > 0; ``plan="rules"`` uses the engine's budget rules, and ``prefetch_depth``,
``activations`` and ``profile`` mean what the CLI flags of those names mean. Trainer does not know the
sequence length before the first batch, and the plan is fixed when the engine is built (at
construction), so the plan is sized for ``FuyouTrainingArguments.seq_len`` when given — set it to your
longest batch (e.g. the tokenizer's ``max_length``) — else for the model's maximum positions
(``max_position_embeddings``/``n_positions``) capped at ``SEQ_LEN_CAP``. The chosen plan is printed
(one line, as the CLI does), kept as ``trainer.plan_choice`` and recorded in each checkpoint's
``fuyou_checkpoint.json``; a batch longer than the planned length warns once (the plan may then
exceed the memory budgets). A profile measured for the plan is saved as ``OUTPUT_DIR/fuyou_profile.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from fuyou.engine import Engine, StepResult
from fuyou.engine.lora import LoraState
from fuyou.errors import ConfigError, FuyouWarning
from fuyou.models.lora import ADAPTER, LoraSettings, base_key, is_lora
from fuyou.models.multimodal import TextPart, is_multimodal, model_part, text_config
from fuyou.run.plan_choice import (
    WARMUP_STEPS,
    ChosenPlan,
    OptimizerSettings,
    PlanRequest,
    check_profile,
    choose_plan,
    engine_config,
)
from fuyou.schedule.state_format import AUTO, CHOICES

SUPPORTED_OPTIMS = ("adamw_torch", "adamw_torch_fused")
FUYOU_CKPT = "fuyou_checkpoint.json"
FUYOU_PROFILE = "fuyou_profile.json"
SEQ_LEN_CAP = 2048
"""Without ``FuyouTrainingArguments.seq_len``, the plan is sized for the model's maximum positions, at most this."""


@dataclasses.dataclass
class FuyouTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus where Fuyou keeps state and how much memory it may use."""

    ssd_dirs: list[str] = dataclasses.field(default_factory=list, metadata={"help": "Store directories, one per SSD."})
    cpu_memory: str = dataclasses.field(default="8GiB", metadata={"help": "Host-memory budget, e.g. 64GiB."})
    gpu_memory: str | None = dataclasses.field(default=None, metadata={"help": "Device-memory budget, e.g. 20GiB."})
    seq_len: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Longest sequence of a batch, what the plan is sized for (default: the model's maximum positions, "
            f"at most {SEQ_LEN_CAP})."
        },
    )
    plan: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto: the cost-model planner picks the engine plan; rules: the engine's simple budget rules."
        },
    )
    profile: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Hardware profile JSON for the planner (default $FUYOU_PROFILE, ~/.cache/fuyou/hw.json, else measured)."
        },
    )
    prefetch_depth: int | None = dataclasses.field(
        default=None, metadata={"help": "Fix the weight prefetch depth instead of planning it."}
    )
    activations: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Fix every layer's activation policy (keep|swap_cpu|swap_ssd|recompute|recompute_cpu) instead of planning it."
        },
    )

    moe_balance: str = dataclasses.field(
        default="global",
        metadata={
            "help": "A mixture of experts' balance loss (weight: the config's router_aux_loss_coef): global (expert "
            "use counted over the whole step), micro (per micro-batch) or off."
        },
    )

    optimizer_state: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "How AdamW's state is stored: auto (a resumed checkpoint's format, else split), split (the "
            "master as the compute weights + a remainder: fp32's updates exactly, fewer bytes), fp32, bf16 "
            "(split with bf16 moments: lossy) or int8 (split with 8-bit block-wise moments: lossy, fewest bytes)."
        },
    )

    @property
    def place_model_on_device(self) -> bool:
        """Never move the whole model to the GPU: Fuyou streams it layer by layer."""
        return False


def _unsupported(args: TrainingArguments) -> list[str]:
    problems = []
    if not isinstance(args, FuyouTrainingArguments):
        problems.append("args must be FuyouTrainingArguments (ssd_dirs, cpu_memory, gpu_memory)")
    elif not args.ssd_dirs:
        problems.append("FuyouTrainingArguments.ssd_dirs is empty: give at least one store directory")
    optim = getattr(args.optim, "value", args.optim)
    if optim not in SUPPORTED_OPTIMS:
        problems.append(f"optim={optim!r} is not supported; Fuyou runs AdamW: use one of {SUPPORTED_OPTIMS}")
    if args.deepspeed:
        problems.append("deepspeed is not supported together with Fuyou (Fuyou replaces its offloading)")
    if args.fsdp:
        problems.append("fsdp is not supported: Fuyou trains on a single device")
    if args.fp16:
        problems.append("fp16 is not supported: use bf16=True (or neither, for fp32)")
    if args.gradient_checkpointing:
        problems.append("gradient_checkpointing is handled by Fuyou's activation policy; leave it off")
    state = getattr(args, "optimizer_state", AUTO)
    if state not in CHOICES:
        problems.append(f"optimizer_state={state!r} is not one of {', '.join(CHOICES)}")
    return problems


class FuyouOptimizer(torch.optim.Optimizer):
    """The optimizer Trainer sees: real ``param_groups`` (schedulers set ``lr``), ``step`` a barrier."""

    def __init__(self, params: Any, lr: float, engine_ref: FuyouTrainer) -> None:
        super().__init__(params, {"lr": lr})
        self._trainer = engine_ref

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # a barrier, no closure: the engine already stepped
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102 - no gradients live on the model
        return None


def _warn_if_bf16_is_slow(backend: Any) -> None:
    """``bf16=True`` on a device that emulates bf16 (AVX2-only CPUs) trains, but warns with the measured factor."""
    import warnings

    from fuyou.device.precision import SLOW_FACTOR, choose_precision
    from fuyou.errors import FuyouWarning

    choice = choose_precision("bf16", backend)
    if (choice.bf16_slowdown or 0) > SLOW_FACTOR:
        warnings.warn(
            f"FuyouTrainer: {choice.reason.replace('--precision fp32 (or auto)', 'bf16=False')}",
            FuyouWarning,
            stacklevel=3,
        )


class FuyouTrainer(Trainer):
    """``transformers.Trainer`` training through the Fuyou engine; see the module docstring."""

    def __init__(self, model: Any = None, args: FuyouTrainingArguments | None = None, **kwargs: Any) -> None:
        if model is None or args is None:
            raise ConfigError("FuyouTrainer needs model= and args=FuyouTrainingArguments(...)")
        problems = _unsupported(args)
        if problems:
            raise ConfigError("FuyouTrainer: " + "; ".join(problems))
        from fuyou.run.plan_choice import device_kind
        from fuyou.run.ranks import join

        super().__init__(model=model, args=args, **kwargs)
        lora, state, config = _peft_parts(model)
        self._part = _text_part(model, lora)
        """Where a multimodal model object holds the language model Fuyou trains (None: a causal LM)."""
        if self._part is not None:
            state, config = _text_state(self._part, state), text_config(config)
        # parameters the model does not train (requires_grad False) are frozen (``--freeze``)
        freeze = (
            ()
            if lora is not None
            else tuple(self._text_names(n for n, p in model.named_parameters() if not p.requires_grad))
        )
        req, seq_from = plan_request(args, config, lora)
        req = dataclasses.replace(req, freeze=freeze)
        self._ranks = join(device_kind(req.device))  # torchrun: Trainer's process group, and Fuyou's shards
        if self._ranks.world > 1:  # Fuyou synchronizes the ranks itself: accelerate must not wrap the model in DDP
            prepare = self.accelerator.prepare_model

            def unwrapped(m: Any, device_placement: Any = None, evaluation_mode: bool = False) -> Any:
                return prepare(m, device_placement=False, evaluation_mode=True)

            self.accelerator.prepare_model = unwrapped
        # the engine plan this trainer runs and how it was chosen (info: source, profile, prediction); rank 0's for all
        log = _stderr if args.should_log and self._ranks.root else lambda s: None
        self.plan_choice = self._ranks.decide(lambda: _choose(req, seq_from, log))
        optim = OptimizerSettings(
            args.learning_rate,
            (args.adam_beta1, args.adam_beta2),
            args.adam_epsilon,
            args.weight_decay,
            args.max_grad_norm or 0.0,
            frozenset(self._text_names(n for n, _ in model.named_parameters()))
            - frozenset(self._text_names(self.get_decay_parameter_names(model))),
        )
        batch = (args.per_device_train_batch_size, req.seq_len, args.gradient_accumulation_steps)
        cfg = engine_config(req, self.plan_choice, optim, batch, args.moe_balance)
        self.engine = Engine.from_state_dict(config, state, cfg)
        if self._ranks.root:
            self.plan_choice.keep_profile()
        if args.bf16:
            _warn_if_bf16_is_slow(self.engine.backend)
        self._planned_seq_len = req.seq_len
        self._plan_req = req
        self._step_times: list[float] = []
        self.profile_check: dict[str, Any] | None = None
        """After ``train``: the run's verdict on the profile it was planned with, as ``fuyou finetune``
        records it in run.json (``plan_choice.check_profile``; None without a prediction or steps)."""
        self._warned_longer = False
        self._pending: list[dict[str, torch.Tensor]] = []
        self._last: StepResult | None = None  # the last engine step's result (loss, grad_norm, …)

    def _text_names(self, names: Iterable[str]) -> list[str]:
        """``names`` (the model object's parameter names) as the engine names them: a multimodal model's
        language-model parameters by their text model's names, its other parameters left out."""
        part = self._part
        return list(names) if part is None else [part.text_key(n) for n in names if part.owns(n)]

    def plan_record(self) -> dict[str, Any]:
        """The chosen plan's info plus the plan the engine executes (what ``fuyou_checkpoint.json`` records)."""
        return {**self.plan_choice.info, "seq_len": self._planned_seq_len, "executed": self.engine.plan.to_json()}

    # ---- Trainer's optional attributes, set by the time these run --------------------------------
    def _model(self) -> torch.nn.Module:
        if self.model is None:
            raise ConfigError("FuyouTrainer needs a model")
        return self.model

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("FuyouTrainer: the optimizer is created by Trainer before training starts")
        return self.optimizer

    def _scheduler(self) -> Any:
        if self.lr_scheduler is None:
            raise RuntimeError("FuyouTrainer: the LR scheduler is created by Trainer before training starts")
        return self.lr_scheduler

    # ---- optimizer -----------------------------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """A ``FuyouOptimizer`` over the model's parameters (for schedulers and logging)."""
        if self.optimizer is None:
            params = [p for p in (model or self._model()).parameters()]
            self.optimizer = FuyouOptimizer(params, self.args.learning_rate, self)
        return self.optimizer

    # ---- training ------------------------------------------------------------------------------
    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """Buffer a micro-batch; on the last one of the accumulation, run one engine step."""
        mb = _micro_batch(inputs)
        if mb["input_ids"].shape[-1] > self._planned_seq_len:
            self._warn_longer(mb["input_ids"].shape[-1])
        self._pending.append(mb)
        if len(self._pending) < self.current_gradient_accumulation_steps:
            return torch.tensor(0.0, device=self.args.device)
        batch, self._pending = self._pending, []
        self.engine.set_lr(self._optimizer().param_groups[0]["lr"])
        n = None if num_items_in_batch is None else int(num_items_in_batch)
        if self._ranks.world > 1 and not self.args.average_tokens_across_devices:
            n = None  # a per-rank count: the engine sums every rank's (the loss is the global batch's mean)
        pos = [b["position_ids"] for b in batch] if all("position_ids" in b for b in batch) else None
        self._last = self.engine.train_micro_batches(
            [b["input_ids"] for b in batch], [b["labels"] for b in batch], n, position_ids=pos
        )
        self._step_times.append(self._last.step_time_s)
        return torch.tensor(self._last.loss, device=self.args.device)

    def _warn_longer(self, seq_len: int) -> None:
        """Once: a batch is longer than the sequence length the plan was sized for."""
        import warnings

        from fuyou.errors import FuyouWarning

        if self._warned_longer:
            return
        self._warned_longer = True
        warnings.warn(
            f"FuyouTrainer: a batch of {seq_len} tokens per sequence is longer than the {self._planned_seq_len} "
            "the engine plan was sized for, so activations may exceed the memory budgets; set "
            "FuyouTrainingArguments.seq_len to the longest batch",
            FuyouWarning,
            stacklevel=3,
        )

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        """Clipping already happened, exactly, in the engine; report its gradient norm."""
        return torch.tensor(self._last.grad_norm if self._last is not None else 0.0)

    # ---- evaluation and saving -----------------------------------------------------------------
    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: Any = None
    ) -> tuple[torch.Tensor, None, None]:
        """Evaluation loss through the engine (the model object's weights are not the trained ones)."""
        mb = _micro_batch(inputs)
        loss = self.engine.evaluate(mb["input_ids"], mb["labels"], mb.get("position_ids"))
        return torch.tensor(loss), None, None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the trained weights as a Hugging Face directory (streamed safetensors), plus the tokenizer."""
        out = str(output_dir or self.args.output_dir)
        if isinstance(
            self.engine.lora, LoraState
        ):  # a PEFT model: its adapter directory, as PeftModel.save_pretrained writes
            self.engine.export_adapter(out, base=getattr(self.engine.adapter.config, "_name_or_path", None) or None)
        elif self._part is not None:  # a multimodal model: the trained language model beside its vision tower
            self._load_trained()
            if self._ranks.root:
                model: Any = self._model()
                model.save_pretrained(out)
        else:
            self.engine.export(out)  # in the model's own dtype, as Trainer saves it; every rank; rank 0 writes
        if self.processing_class is not None and self._ranks.root:
            self.processing_class.save_pretrained(out)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Train, then load the final weights into ``self.model`` so it can be used right away."""
        out = super().train(*args, **kwargs)
        self.engine.flush()
        self._check_profile()
        if isinstance(self.engine.lora, LoraState):  # a PEFT model: its base stayed frozen, its adapters trained
            trained = self.engine.lora.state_dict()
            peft_model: Any = self._model()
            named = dict(peft_model.get_base_model().named_parameters())
            with torch.no_grad():
                for name, t in trained.items():
                    named[name.replace(f".{ADAPTER}.", f".{peft_model.active_adapter}.")].copy_(t)
            return out
        self._load_trained()
        return out

    def _load_trained(self) -> None:
        """Copy the engine's trained weights into ``self.model`` (on every rank: a collective)."""
        trained = dict(self.engine.master_weights(everywhere=True))
        part = self._part
        with torch.no_grad():
            for name, p in self._model().named_parameters():
                key = part.text_key(name) if part is not None and part.owns(name) else name
                if key in trained:
                    p.copy_(trained[key])

    def _check_profile(self) -> None:
        """Hold the plan's predicted step time against the steady steps measured (``profile_check``), as
        ``fuyou finetune`` does: a quick profile off by more than the tolerance is measured again and
        replaced, with a FuyouWarning when the cached one was stale."""
        steady = self._step_times[WARMUP_STEPS:]
        if not self._ranks.root or not steady:
            return
        log = _stderr if self.args.should_log else lambda s: None
        self.profile_check = check_profile(self.plan_choice, self._plan_req, statistics.median(steady), log)
        check = self.profile_check
        if check and check["verdict"] == "re-measured":
            if check["cached"]:
                warnings.warn(check["note"], FuyouWarning, stacklevel=3)
            else:
                log(f"planner: {check['note']}")

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Trainer's checkpoint (and its ``save_total_limit`` rotation), then the same rotation for
        the copy-free checkpoints of the SSD state."""
        super()._save_checkpoint(model, trial)
        if (
            self.args.save_total_limit
            and self.args.save_total_limit > 0
            and (self.args.should_save or self._ranks.world > 1)
        ):
            self._prune_fuyou_checkpoints(self._get_output_dir(trial=trial))

    def _prune_fuyou_checkpoints(self, run_dir: str) -> list[str]:
        """Delete this run's copy-free checkpoints whose ``checkpoint-N`` directory in ``run_dir`` is gone
        (rotated away by ``save_total_limit``) or no longer refers to them; return their names."""
        from fuyou.checkpoint import list_checkpoints, remove, trainer_state
        from fuyou.errors import ManifestError

        stripes = list(self.engine.store.dirs)
        run_dir = os.path.abspath(run_dir)
        gone = []
        for name in list_checkpoints(stripes):
            try:
                hf_dir = trainer_state(stripes, name).get("hf_checkpoint")
            except ManifestError:
                continue
            if not isinstance(hf_dir, str) or os.path.dirname(hf_dir) != run_dir or _refers(hf_dir, name):
                continue
            remove(stripes, name)
            gone.append(name)
        return gone

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Checkpoint the SSD state copy-free (hard links) and save the LR scheduler as Trainer does.
        With several ranks each checkpoints its own store; rank 0 marks the checkpoint once all hold it
        and writes the Trainer checkpoint's files."""
        from fuyou.checkpoint import take
        from fuyou.checkpoint.resume import mark_all_ranks

        self.engine.flush()
        name = self._ranks.share(f"hf-{os.path.basename(os.path.normpath(output_dir))}-{self.engine.store.version}")
        take(
            self.engine.store,
            name,
            {"hf_checkpoint": os.path.abspath(output_dir), "step": self.state.global_step},
            replace=True,
        )
        self._ranks.barrier()  # every rank holds it
        if self._ranks.world > 1 and self._ranks.root:
            mark_all_ranks(list(self.engine.store.dirs), name, self._ranks.world)
        if self._ranks.root:
            record = {"stripes": list(self.engine.store.dirs), "name": name, "plan": self.plan_record()}
            with open(os.path.join(output_dir, FUYOU_CKPT), "w") as f:
                json.dump(record | {"ranks": self._ranks.world}, f)
            torch.save(self._scheduler().state_dict(), os.path.join(output_dir, "scheduler.pt"))
        self._ranks.barrier()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """``resume_from_checkpoint``: restore the SSD state (weights, master, m, v, step) and the scheduler."""
        if checkpoint is None:
            return
        from fuyou.checkpoint import restore, validate
        from fuyou.checkpoint.resume import all_ranks_hold

        path = os.path.join(checkpoint, FUYOU_CKPT)
        if not os.path.isfile(path):
            raise ConfigError(f"{checkpoint} has no {FUYOU_CKPT}: it was not written by FuyouTrainer")
        with open(path) as f:
            ref = json.load(f)
        world = self._ranks.world
        if ref.get("ranks", 1) != world:
            raise ConfigError(
                f"{checkpoint} was saved by {ref.get('ranks', 1)} ranks; resume it with as many, not {world}"
            )
        stripes = ref["stripes"] if world == 1 else list(self.engine.store.dirs)  # each rank its own store
        err = ""
        try:
            validate(stripes, ref["name"])
            if world > 1 and self._ranks.root and not all_ranks_hold(stripes, ref["name"], world):
                err = "not every rank finished saving it"
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = str(e)
        if not self._ranks.all_ok(not err):
            raise ConfigError(f"cannot resume from {checkpoint}: {err or 'another rank cannot (see its message)'}")
        cfg = self.engine.cfg
        self.engine.close()
        restore(stripes, ref["name"])
        self.engine = Engine.resume(cfg)
        sched = self._scheduler()
        sched.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))
        # Trainer gets the current lr back from the optimizer's saved param_groups; ours come from the scheduler.
        for group, lr in zip(self._optimizer().param_groups, sched.get_last_lr()):
            group["lr"] = lr

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The weights come back with the SSD state in ``_load_optimizer_and_scheduler``."""


def _text_part(model: Any, lora: Any) -> TextPart | None:
    """Where the multimodal ``model`` holds its language model (None for a causal LM). Raises ConfigError
    for a PEFT multimodal model, or one whose vision tower or projector would train (requires_grad):
    Fuyou trains the language model only, so they must be frozen for it to train what plain Trainer would."""
    if not is_multimodal(getattr(model, "config", None)):
        return None
    if lora is not None or not hasattr(model, "get_output_embeddings"):
        raise ConfigError(
            "FuyouTrainer trains a multimodal model object in full, not through PEFT; for LoRA on its "
            "language model run fuyou finetune MODEL_DIR --lora-rank R on the checkpoint"
        )
    part = model_part(model)
    trained = [n for n, p in model.named_parameters() if p.requires_grad and not part.owns(n)]
    if trained:
        raise ConfigError(
            f"FuyouTrainer trains a multimodal model's language model only, but {len(trained)} other parameters "
            f"would train (e.g. {trained[0]}); freeze the vision tower and projector first "
            "(requires_grad_(False)) so that plain Trainer would train the same"
        )
    return part


def _text_state(part: TextPart, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's tensors of a multimodal model's ``state`` dict, by its text model's names."""
    return {part.text_key(k): v for k, v in state.items() if part.owns(k)}


def _peft_parts(model: Any) -> tuple[LoraSettings | None, dict[str, torch.Tensor], Any]:
    """(LoRA settings, the engine's state dict, the base model's config) of ``model``: a plain HF model
    (no LoRA), or a ``peft`` model with one LoRA adapter (its base streamed frozen, the adapters
    trained from their current values). Raises ConfigError for PEFT features Fuyou does not train."""
    try:
        from peft import PeftModel
    except ImportError:
        return None, model.state_dict(), model.config
    if not isinstance(model, PeftModel):
        return None, model.state_dict(), model.config
    pcs = model.peft_config
    pc: Any = pcs.get(model.active_adapter)  # a LoraConfig when the checks below pass
    problems = []
    if len(pcs) != 1 or pc is None:
        problems.append(f"one adapter (this model has {sorted(pcs)})")
    elif getattr(pc.peft_type, "value", pc.peft_type) != "LORA":
        problems.append(f"LoRA adapters (this one is {pc.peft_type})")
    else:
        for flag in ("use_dora", "use_rslora", "modules_to_save", "layers_to_transform"):
            if getattr(pc, flag, None):
                problems.append(f"no {flag}")
        if pc.bias != "none":
            problems.append('bias="none"')
        if float(pc.lora_alpha) != int(pc.lora_alpha):
            problems.append(f"an integer lora_alpha (not {pc.lora_alpha})")
    if problems:
        raise ConfigError("FuyouTrainer trains PEFT models with " + ", ".join(problems))
    targets = pc.target_modules
    settings = LoraSettings(
        int(pc.r),
        int(pc.lora_alpha),
        float(pc.lora_dropout),
        (targets,) if isinstance(targets, str) else tuple(sorted(targets)),
    )
    base = model.get_base_model()
    state = {}
    for k, v in base.state_dict().items():
        if is_lora(k):
            state[k.replace(f".{model.active_adapter}.", f".{ADAPTER}.")] = v
        else:
            state[base_key(k)] = v
    return settings, state, base.config


def plan_request(args: FuyouTrainingArguments, config: Any, lora: Any = None) -> tuple[PlanRequest, str]:
    """The plan chooser's request for a Trainer run of a model with ``config`` (``lora``: the
    ``LoraSettings`` of adapters on a frozen base), and where its sequence length came from (``seq_len``,
    else the model's maximum positions capped: see the module docstring)."""
    if args.seq_len is not None:
        seq_len, seq_from = args.seq_len, "FuyouTrainingArguments.seq_len"
    else:
        max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        seq_len = min(int(max_pos or SEQ_LEN_CAP), SEQ_LEN_CAP)
        seq_from = f"the model's {max_pos} positions, at most {SEQ_LEN_CAP}" if max_pos else "no seq_len given"
        seq_from += "; set FuyouTrainingArguments.seq_len to the longest batch"
    req = PlanRequest(
        model_config=config,
        store_dirs=tuple(args.ssd_dirs),
        cpu_memory=args.cpu_memory,
        gpu_memory=args.gpu_memory,
        device="cpu" if args.use_cpu else "auto",
        precision="bf16" if args.bf16 else "fp32",
        optimizer_state=args.optimizer_state,
        micro_batch_size=args.per_device_train_batch_size,
        grad_accum=args.gradient_accumulation_steps,
        seq_len=seq_len,
        clip=bool(args.max_grad_norm),
        mode=args.plan,
        prefetch_depth=args.prefetch_depth,
        activations=args.activations,
        profile=args.profile,
        profile_out=os.path.join(str(args.output_dir), FUYOU_PROFILE),
        ranks=max(1, args.world_size),
        lora=lora,
    )
    return req, seq_from


def _choose(req: PlanRequest, seq_from: str, log: Callable[[str], None]) -> ChosenPlan:
    """``choose_plan``, saying which sequence length the plan is sized for; a plan that does not fit names it too."""
    from fuyou.planner.search import InfeasibleError

    if req.mode == "auto":
        log(
            f"FuyouTrainer: planning for {req.micro_batch_size} × {req.grad_accum} sequences of {req.seq_len} tokens "
            f"per step (length from {seq_from})"
        )
    try:
        return choose_plan(req, log)
    except InfeasibleError as e:
        raise InfeasibleError(f"{e} (FuyouTrainer planned for sequences of {req.seq_len} tokens: {seq_from})") from e


def _stderr(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr)


def _refers(hf_dir: str, name: str) -> bool:
    """True if Trainer checkpoint directory ``hf_dir`` exists and names copy-free checkpoint ``name``."""
    try:
        with open(os.path.join(hf_dir, FUYOU_CKPT)) as f:
            return json.load(f).get("name") == name
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True  # unreadable for another reason: keep the checkpoint rather than guess


def _micro_batch(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """input_ids and labels (and position_ids, when the collator packs documents) of a collated
    batch; right padding is allowed, left padding is not.

    With right padding and a causal model, real tokens never attend to the padding after them, so
    dropping the attention mask (and masking the padding's labels) computes the same loss.
    """
    if inputs.get("pixel_values") is not None:
        raise ConfigError(
            "FuyouTrainer trains a multimodal model's language model on text; this batch holds pixel_values "
            "(images): pass text-only batches"
        )
    ids = inputs["input_ids"]
    labels = inputs.get("labels", ids)
    mask = inputs.get("attention_mask")
    if mask is not None and not torch.equal(mask, mask.cumprod(dim=-1)):
        raise ConfigError("FuyouTrainer supports right padding only (pad after the tokens, padding_side='right')")
    if mask is not None:
        labels = labels.masked_fill(mask == 0, -100)
    out = {"input_ids": ids, "labels": labels}
    if inputs.get("position_ids") is not None:  # packed sequences (DataCollatorWithFlattening): per-document positions
        out["position_ids"] = inputs["position_ids"]
    return out
