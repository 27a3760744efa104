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
stay, and the best model's when tracked), and ``resume_from_checkpoint``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.errors import ConfigError

SUPPORTED_OPTIMS = ("adamw_torch", "adamw_torch_fused")
FUYOU_CKPT = "fuyou_checkpoint.json"


@dataclasses.dataclass
class FuyouTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus where Fuyou keeps state and how much memory it may use."""

    ssd_dirs: list[str] = dataclasses.field(default_factory=list, metadata={"help": "Store directories, one per SSD."})
    cpu_memory: str = dataclasses.field(default="8GiB", metadata={"help": "Host-memory budget, e.g. 64GiB."})
    gpu_memory: str | None = dataclasses.field(default=None, metadata={"help": "Device-memory budget, e.g. 20GiB."})

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
    return problems


class FuyouOptimizer(torch.optim.Optimizer):
    """The optimizer Trainer sees: real ``param_groups`` (schedulers set ``lr``), ``step`` a barrier."""

    def __init__(self, params: Any, lr: float, engine_ref: "FuyouTrainer") -> None:
        super().__init__(params, {"lr": lr})
        self._trainer = engine_ref

    def step(self, closure: Any = None) -> None:  # noqa: D102 - the engine already stepped
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
        warnings.warn(f"FuyouTrainer: {choice.reason.replace('--precision fp32 (or auto)', 'bf16=False')}",
                      FuyouWarning, stacklevel=3)


class FuyouTrainer(Trainer):
    """``transformers.Trainer`` training through the Fuyou engine; see the module docstring."""

    def __init__(self, model: Any = None, args: FuyouTrainingArguments | None = None, **kwargs: Any) -> None:
        if model is None or args is None:
            raise ConfigError("FuyouTrainer needs model= and args=FuyouTrainingArguments(...)")
        problems = _unsupported(args)
        if problems:
            raise ConfigError("FuyouTrainer: " + "; ".join(problems))
        super().__init__(model=model, args=args, **kwargs)
        cfg = EngineConfig(
            ssd_dirs=tuple(args.ssd_dirs), cpu_memory=args.cpu_memory, gpu_memory=args.gpu_memory,
            device="cpu" if args.use_cpu else "auto", precision="bf16" if args.bf16 else "fp32",
            lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
            weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm or 0.0,
            no_decay=frozenset(n for n, _ in model.named_parameters()) - frozenset(self.get_decay_parameter_names(model)),
            plan=Plan(micro_batches=args.gradient_accumulation_steps))
        self.engine = Engine.from_state_dict(model.config, model.state_dict(), cfg)
        if args.bf16:
            _warn_if_bf16_is_slow(self.engine.backend)
        self._pending: list[dict[str, torch.Tensor]] = []
        self._last: dict = {}

    # ---- optimizer -----------------------------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """A ``FuyouOptimizer`` over the model's parameters (for schedulers and logging)."""
        if self.optimizer is None:
            params = [p for p in (model or self.model).parameters()]
            self.optimizer = FuyouOptimizer(params, self.args.learning_rate, self)
        return self.optimizer

    # ---- training ------------------------------------------------------------------------------
    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """Buffer a micro-batch; on the last one of the accumulation, run one engine step."""
        self._pending.append(_micro_batch(inputs))
        if len(self._pending) < self.current_gradient_accumulation_steps:
            return torch.tensor(0.0, device=self.args.device)
        batch, self._pending = self._pending, []
        self.engine.set_lr(self.optimizer.param_groups[0]["lr"])
        n = None if num_items_in_batch is None else int(num_items_in_batch)
        self._last = self.engine.train_micro_batches([b["input_ids"] for b in batch], [b["labels"] for b in batch], n)
        return torch.tensor(self._last["loss"], device=self.args.device)

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        """Clipping already happened, exactly, in the engine; report its gradient norm."""
        return torch.tensor(self._last.get("grad_norm", 0.0))

    # ---- evaluation and saving -----------------------------------------------------------------
    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: Any = None) -> tuple[torch.Tensor, None, None]:
        """Evaluation loss through the engine (the model object's weights are not the trained ones)."""
        mb = _micro_batch(inputs)
        return torch.tensor(self.engine.evaluate(mb["input_ids"], mb["labels"])), None, None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the trained weights as a Hugging Face directory (streamed safetensors), plus the tokenizer."""
        out = output_dir or self.args.output_dir
        self.engine.export(out, dtype="bf16" if self.args.bf16 else "fp32")
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Train, then load the final weights into ``self.model`` so it can be used right away."""
        out = super().train(*args, **kwargs)
        self.engine.flush()
        trained = dict(self.engine.master_weights())
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in trained:
                    p.copy_(trained[name])
        return out

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Trainer's checkpoint (and its ``save_total_limit`` rotation), then the same rotation for
        the copy-free checkpoints of the SSD state."""
        super()._save_checkpoint(model, trial)
        if self.args.save_total_limit and self.args.save_total_limit > 0 and self.args.should_save:
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
        """Checkpoint the SSD state copy-free (hard links) and save the LR scheduler as Trainer does."""
        from fuyou.checkpoint import take

        self.engine.flush()
        name = f"hf-{os.path.basename(os.path.normpath(output_dir))}-{self.engine.store.version}"
        take(self.engine.store, name, {"hf_checkpoint": os.path.abspath(output_dir), "step": self.state.global_step},
             replace=True)
        with open(os.path.join(output_dir, FUYOU_CKPT), "w") as f:
            json.dump({"stripes": list(self.engine.store.dirs), "name": name}, f)
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """``resume_from_checkpoint``: restore the SSD state (weights, master, m, v, step) and the scheduler."""
        if checkpoint is None:
            return
        from fuyou.checkpoint import restore, validate

        path = os.path.join(checkpoint, FUYOU_CKPT)
        if not os.path.isfile(path):
            raise ConfigError(f"{checkpoint} has no {FUYOU_CKPT}: it was not written by FuyouTrainer")
        with open(path) as f:
            ref = json.load(f)
        validate(ref["stripes"], ref["name"])
        cfg = self.engine.cfg
        self.engine.close()
        restore(ref["stripes"], ref["name"])
        self.engine = Engine.resume(cfg)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))
        # Trainer gets the current lr back from the optimizer's saved param_groups; ours come from the scheduler.
        for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
            group["lr"] = lr

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The weights come back with the SSD state in ``_load_optimizer_and_scheduler``."""


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
    """input_ids and labels of a collated batch; right padding is allowed, left padding is not.

    With right padding and a causal model, real tokens never attend to the padding after them, so
    dropping the attention mask (and masking the padding's labels) computes the same loss.
    """
    ids = inputs["input_ids"]
    labels = inputs.get("labels", ids)
    mask = inputs.get("attention_mask")
    if mask is not None and not torch.equal(mask, mask.cumprod(dim=-1)):
        raise ConfigError("FuyouTrainer supports right padding only (pad after the tokens, padding_side='right')")
    if mask is not None:
        labels = labels.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "labels": labels}
