"""One rank of a 2-rank Trainer run under torchrun, for test_data_parallel_trainer.

    torchrun --nproc-per-node 2 -m tests.integration.trainer_dp_child plain|fuyou[_lora] OUT [RESUME]

``plain``: transformers.Trainer with DDP (gloo), the reference; ``fuyou``: FuyouTrainer; ``_lora``: the
model wrapped by ``peft`` first (the same adapters on both). Rank 0 saves the per-step losses and final
weights to OUT/result.pt.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import Trainer, TrainingArguments

from tests.integration.test_hf_trainer import COMMON, dataset, losses, peft_model
from tests.integration.tiny_models import tiny


def main(kind: str, out: str, resume: str | None = None) -> None:
    from fuyou import FuyouTrainer, FuyouTrainingArguments

    _, model = tiny("llama_tied", layers=2)
    lora, kind = kind.endswith("_lora"), kind.removesuffix("_lora")
    if lora:
        model = peft_model(model, seed=0)
    common = COMMON | dict(per_device_train_batch_size=1, save_strategy="steps", save_steps=2, save_total_limit=2)
    if kind == "plain":
        args = TrainingArguments(output_dir=out, optim="adamw_torch", **common)
        trainer = Trainer(model=model, args=args, train_dataset=dataset())
    else:
        ssd = os.path.join(out, "ssd")
        os.makedirs(ssd, exist_ok=True)
        args = FuyouTrainingArguments(output_dir=out, optim="adamw_torch", ssd_dirs=[ssd], cpu_memory="64MiB", **common)
        trainer = FuyouTrainer(model=model, args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    if kind == "fuyou":
        trainer.save_model(os.path.join(out, "saved"))
    if int(os.environ.get("RANK", "0")) == 0:
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"losses": losses(trainer), "weights": sd}, os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
    # Trainer (through accelerate) leaves its process group alive; torn down by interpreter exit, gloo's
    # threads can abort the process after a successful run ("terminate called without an active exception")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
