"""FuyouTrainer under torchrun (2 ranks, gloo) trains what transformers.Trainer with DDP trains, and
resumes from its checkpoint bit-identically (``trainer_dp_child``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    p = subprocess.run(
        cmd + ["-m", "tests.integration.trainer_dp_child", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=600, env=env | {"FUYOU_COLLECTIVE_TIMEOUT": "120"},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]


@pytest.mark.slow  # ~1 min: three 2-rank launches
def test_two_rank_trainer_equals_ddp_and_resumes_bit_identically(tmp_path) -> None:
    plain, fy = str(tmp_path / "plain"), str(tmp_path / "fuyou")
    torchrun("plain", plain)
    torchrun("fuyou", fy)
    ref, got = torch.load(os.path.join(plain, "result.pt")), torch.load(os.path.join(fy, "result.pt"))
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for k, v in ref["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, rtol=1e-5, atol=1e-5, msg=k)
    assert sorted(os.listdir(os.path.join(fy, "ssd"))) == ["rank0", "rank1"]  # each rank its own store
    assert os.path.isfile(os.path.join(fy, "saved", "model.safetensors.index.json"))
    os.replace(os.path.join(fy, "result.pt"), os.path.join(fy, "full.pt"))
    torchrun("fuyou", fy, os.path.join(fy, "checkpoint-4"))
    full, resumed = torch.load(os.path.join(fy, "full.pt")), torch.load(os.path.join(fy, "result.pt"))
    assert resumed["losses"] == full["losses"]
    assert all(torch.equal(resumed["weights"][k], v) for k, v in full["weights"].items())


@pytest.mark.slow  # ~45 s: two 2-rank launches
def test_two_rank_trainer_on_a_peft_model_equals_ddp(tmp_path) -> None:
    """A ``peft`` LoRA model under torchrun: FuyouTrainer streams the base sharded and frozen and sums the
    adapters' gradients over ranks; losses and adapters equal transformers.Trainer with DDP."""
    plain, fy = str(tmp_path / "plain"), str(tmp_path / "fuyou")
    torchrun("plain_lora", plain)
    torchrun("fuyou_lora", fy)
    ref, got = torch.load(os.path.join(plain, "result.pt")), torch.load(os.path.join(fy, "result.pt"))
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    adapters = [k for k in ref["weights"] if "lora_" in k]
    assert adapters and ref["weights"].keys() == got["weights"].keys()
    for k, v in ref["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, rtol=1e-5, atol=1e-5, msg=k)
    assert os.path.isfile(os.path.join(fy, "saved", "adapter_model.safetensors"))
