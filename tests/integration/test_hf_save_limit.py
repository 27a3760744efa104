"""FuyouTrainer honours save_total_limit: its copy-free checkpoints follow Trainer's rotation (newest N,
plus the best model's checkpoint when one is tracked), and a kept one still resumes."""

import os

import pytest

from fuyou import FuyouTrainer, FuyouTrainingArguments
from fuyou.checkpoint import list_checkpoints, trainer_state, validate
from tests.integration.test_hf_trainer import COMMON, dataset, losses
from tests.integration.tiny_models import tiny


def trainer(tmp_path, data, **kw):
    ssd = tmp_path / "ssd"
    ssd.mkdir(exist_ok=True)
    _, model = tiny("llama_tied", layers=2)
    args = FuyouTrainingArguments(
        output_dir=str(tmp_path / "out"),
        optim="adamw_torch",
        ssd_dirs=[str(ssd)],
        cpu_memory="64MiB",
        **{**COMMON, "max_steps": 5, "save_strategy": "steps", "save_steps": 1, **kw},
    )
    return FuyouTrainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4])


def hf_dirs(tmp_path):
    out = tmp_path / "out"
    return sorted(str(out / d) for d in os.listdir(out) if d.startswith("checkpoint-"))


def fuyou_dirs(tmp_path):
    stripes = [str(tmp_path / "ssd")]
    return sorted(trainer_state(stripes, n)["hf_checkpoint"] for n in list_checkpoints(stripes))


def test_save_total_limit_prunes_the_copy_free_checkpoints(tmp_path):
    data = dataset()
    fy = trainer(tmp_path, data, save_total_limit=2)
    fy.train()
    kept = hf_dirs(tmp_path)
    assert [os.path.basename(d) for d in kept] == ["checkpoint-4", "checkpoint-5"]
    assert fuyou_dirs(tmp_path) == kept  # used to keep all 5 copy-free checkpoints
    stripes = [str(tmp_path / "ssd")]
    assert [trainer_state(stripes, n)["step"] for n in list_checkpoints(stripes)] == [5, 4]
    for n in list_checkpoints(stripes):
        validate(stripes, n)

    again = trainer(tmp_path, data, save_total_limit=2)  # a kept checkpoint resumes
    again.train(resume_from_checkpoint=kept[0])
    assert losses(again)[-1] == pytest.approx(losses(fy)[-1], rel=1e-6)  # step 5 redone from step 4's state


def test_save_total_limit_keeps_the_best_model_checkpoint(tmp_path):
    data = dataset()
    # the loss falls, so with greater_is_better the first checkpoint stays the best one
    fy = trainer(
        tmp_path,
        data,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
    )
    fy.train()
    best = fy.state.best_model_checkpoint
    kept = hf_dirs(tmp_path)
    assert best in kept and kept[-1].endswith("checkpoint-5") and len(kept) == 2, (best, kept)
    assert fuyou_dirs(tmp_path) == kept
