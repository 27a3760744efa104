"""``--report-to tensorboard``: a run's per-step metrics as TensorBoard scalars in ``OUTPUT/tensorboard/``.

The scalars are the numbers of the run's ``metrics.jsonl`` lines (``scalars`` maps one line to its tags),
written from the same place in the loop, plus the held-out loss where the run computes it (before the
first step and after the last). Only rank 0 writes. A resumed run appends to the same directory: its
writer purges what the earlier run logged from the first step it redoes on (TensorBoard hides it).
Needs the ``report`` extra (``tensorboard``); ``require_tensorboard`` says so before training starts.
"""

from __future__ import annotations

import os
from typing import Any

from fuyou.errors import ConfigError

LOG_DIR = "tensorboard"
"""The event files' directory, inside the run directory."""

TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "moe_balance_loss": "train/moe_balance_loss",
    "tokens_per_s": "speed/tokens_per_s",
    "tflops": "speed/tflops",
    "step_time_s": "speed/step_time_s",
    "ssd_read_gb": "ssd/read_gb",
    "ssd_write_gb": "ssd/write_gb",
    "comm_gb": "comm/gb",
}
"""The scalar tag of each numeric key of a metrics.jsonl line (keys a line lacks are skipped)."""

BUSY_PREFIX = "busy/"
"""Tag prefix of the busy fractions: ``busy/<resource>`` (``fuyou.timeline.RESOURCES``), 0 to 1."""

EVAL_TAG = "eval/loss"
"""Tag of the held-out loss: at step 0 (before training) and at the last step (after it)."""

INSTALL = 'pip install -e ".[report]"'
"""How to install the report extra (tensorboard, matplotlib)."""


def require_tensorboard() -> None:
    """Check that TensorBoard logging can start. Raises ConfigError (one line naming the install command)
    when the ``tensorboard`` package is missing or too old for ``torch.utils.tensorboard``."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401 - the import is the check
    except ImportError as e:
        raise ConfigError(
            f"--report-to tensorboard needs the tensorboard package ({e}); install it with {INSTALL}"
        ) from None


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one metrics.jsonl line ``rec``: tag → value (loss, lr, grad norm,
    tokens/s, TFLOPS, step seconds, SSD GB read and written in the step, busy fraction per resource)."""
    out = {tag: float(rec[key]) for key, tag in TAGS.items() if rec.get(key) is not None}
    out.update({BUSY_PREFIX + r: float(f) for r, f in rec.get("busy_frac", {}).items()})
    return out


class TensorBoardLog:
    """Writes a run's step records and held-out losses into ``run_dir``/tensorboard (rank 0 only).

    ``resumed_from``: the steps an earlier run already logged that this one keeps (0 on a fresh start);
    what was logged at later steps is purged, so a resumed or restarted run shows each step once.
    Raises ConfigError (``require_tensorboard``) without the tensorboard package.
    """

    def __init__(self, run_dir: str, resumed_from: int = 0) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(run_dir, LOG_DIR)
        # a fresh start purges everything (step ≥ 0); a resume what follows its checkpoint's step
        self._writer = SummaryWriter(self.log_dir, purge_step=resumed_from + 1 if resumed_from else 0)

    def step(self, rec: dict[str, Any]) -> None:
        """Log one metrics.jsonl line ``rec`` at its ``step`` (1-based) and flush it to disk, so a
        running TensorBoard shows it."""
        for tag, value in scalars(rec).items():
            self._writer.add_scalar(tag, value, rec["step"])
        self._writer.flush()

    def eval_loss(self, step: int, loss: float | None) -> None:
        """Log the held-out loss measured after ``step`` steps (0: before training); None: no held-out data."""
        if loss is not None:
            self._writer.add_scalar(EVAL_TAG, loss, step)
            self._writer.flush()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc: object) -> None:
        """Flush and close the event file (also when the run stops with an error)."""
        self._writer.close()
