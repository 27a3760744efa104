"""Child for the RSS test: train a model from a safetensors directory under a host budget and print
resident-memory figures (JSON): baseline after imports, peak (VmHWM) over import + training.

    python -m tests.integration.rss_child MODEL_DIR SSD BUDGET_BYTES POLICY STEPS [LORA_RANK]
"""

import json
import sys

import numba  # noqa: F401 - imported before the baseline, like torch and transformers
import torch
import transformers  # noqa: F401

from fuyou.device import get_backend
from fuyou.device.precision import choose_precision
from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.models.lora import LoraSettings


def status(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    model_dir, ssd, budget, policy, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    rank = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    lora = LoraSettings(rank=rank, alpha=2 * rank, targets=("q_proj", "v_proj")) if rank else None
    base = status("VmRSS")
    with open(model_dir + "/config.json") as f:
        nblocks = json.load(f)["num_hidden_layers"] + 2
    plan = Plan(prefetch_depth=1, activation_policy=("keep",) + (policy,) * (nblocks - 2) + ("keep",))
    precision = choose_precision("auto", get_backend("cpu")).precision  # as `fuyou finetune` runs on this CPU
    ec = EngineConfig(ssd_dirs=(ssd,), cpu_memory=budget, plan=plan, precision=precision, lora=lora)
    with Engine.from_pretrained(model_dir, ec) as eng:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, eng.adapter.config.vocab_size, (1, 64), generator=g)
        losses = [eng.train_step(ids)["loss"] for _ in range(steps)]
        eng.flush()  # a checkpoint's write: LoRA adapters staged through the pool
        pool_peak = eng.pool.peak
    print(
        json.dumps(
            {
                "base": base,
                "peak": status("VmHWM"),
                "growth": status("VmHWM") - base,
                "pool_peak": pool_peak,
                "budget": budget,
                "losses": losses,
            }
        )
    )


if __name__ == "__main__":
    main()
