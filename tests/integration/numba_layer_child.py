"""Child for the threading-layer test: train a tiny model with Fuyou (both schedules) and with plain
PyTorch + AdamW, under whatever ``NUMBA_THREADING_LAYER`` the parent set; print the layer numba used
and the deviations (JSON), or fail an assertion.

The model is wide and the batch small, so each block's Adam update (worker thread) outlasts the
next block's backward: the gradient norm's kernel (training thread) is launched while Adam's runs,
every step. numba's ``workqueue`` layer aborts the process on that unless launches are guarded.

Usage: python -m tests.integration.numba_layer_child WORK_DIR
"""

import json
import pathlib
import sys

import numba
import torch

from fuyou.optim.parallel import threading_layer
from tests.integration.test_engine_fidelity import LR, WD, run_fuyou
from tests.integration.tiny_models import batches, reference_steps, tiny

STEPS, LAYERS, HIDDEN = 4, 6, 256
CLIPS = (0.0, 1.0)
"""0: the overlap_backward schedule (Adam during the backward pass); 1.0: overlap_next_forward."""


def deviations(ref_model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(largest |Fuyou - reference| weight difference, fraction of elements off by more than 1e-5
    of their tensor's scale). Adam turns a near-zero gradient's rounding noise into a ±lr step, so
    a few elements of a correct run differ by up to 2·lr·steps; a wrong update moves many."""
    sd = ref_model.state_dict()
    worst, off, total = 0.0, 0, 0
    for k, w in weights.items():
        d = (w - sd[k]).abs()
        worst = max(worst, d.max().item())
        off += int((d > 1e-5 * sd[k].abs().max()).sum())
        total += d.numel()
    return worst, off / total


def main() -> None:
    work = pathlib.Path(sys.argv[1])
    out = {"requested": numba.config.THREADING_LAYER}
    for clip in CLIPS:
        cfg, model = tiny("llama", layers=LAYERS, hidden=HIDDEN)
        data = batches(STEPS, batch=2, seq=8)
        (work / f"clip{clip}").mkdir()
        losses, weights = run_fuyou(cfg, model, work / f"clip{clip}", data, clip=clip, policy="keep")
        ref_losses = reference_steps(model, data, 1, LR, WD, clip=clip)
        worst, off = deviations(model, weights)
        out[f"clip={clip}"] = {"losses": losses, "reference": ref_losses, "max_weight_diff": worst, "off_fraction": off}
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses)), (clip, losses, ref_losses)
        assert worst <= 2 * LR * STEPS and off <= 1e-4, (clip, worst, off)
    out["layer"] = threading_layer()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
