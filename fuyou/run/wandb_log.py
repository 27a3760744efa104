"""``--report-to wandb``: a run's per-step metrics and held-out losses in Weights & Biases, as
``transformers.Trainer``'s ``report_to="wandb"`` does.

The numbers and names are TensorBoard's (``fuyou.run.tensorboard.scalars``: ``train/loss``,
``speed/tokens_per_s``, ``busy/<resource>``, ``eval/loss`` …), plotted against ``train/step``, so a
resumed run that redoes steps logs them again without breaking W&B's increasing-step rule. The W&B run
is named after the run directory and its id is kept in ``OUTPUT/wandb-run-id``: a resume continues
the same W&B run. W&B's own settings apply (``WANDB_PROJECT``, default ``fuyou``; ``WANDB_MODE=offline``
logs without network, ``wandb sync`` uploads later; ``WANDB_DIR``, default the run directory). Only
rank 0 logs. Needs the ``wandb`` extra; ``require_wandb`` says so before any work.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from fuyou.errors import ConfigError
from fuyou.run.tensorboard import EVAL_TAG, scalars

INSTALL = 'pip install -e ".[wandb]"'
"""How to install the wandb extra."""

ID_FILE = "wandb-run-id"
"""In the run directory: the W&B run id, so a resumed run logs into the same W&B run."""

STEP = "train/step"
"""The x axis of every metric (the step it was measured after; 0: before training)."""


def require_wandb() -> None:
    """Raise ConfigError (one line naming the install command) when the ``wandb`` package is missing."""
    try:
        import wandb  # noqa: F401 - the import is the check
    except ImportError as e:
        raise ConfigError(f"--report-to wandb needs the wandb package ({e}); install it with {INSTALL}") from None


class WandbLog:
    """Logs a run's step records and held-out losses to one W&B run (rank 0 only).

    ``run_dir``: the run directory (its name names the W&B run; it keeps the id); ``config``: the
    run's settings, recorded as the W&B run's config; ``resumed``: whether this run continues one whose
    W&B run it then resumes. Raises ConfigError without the package.
    """

    def __init__(self, run_dir: str, config: dict[str, Any], resumed: bool = False) -> None:
        require_wandb()
        import wandb

        id_path = os.path.join(run_dir, ID_FILE)
        run_id = open(id_path).read().strip() if resumed and os.path.isfile(id_path) else uuid.uuid4().hex[:12]
        with open(id_path, "w") as f:
            f.write(run_id)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "fuyou"),
            name=os.path.basename(run_dir.rstrip("/")),
            id=run_id,
            resume="allow",
            dir=os.environ.get("WANDB_DIR", run_dir),
            config=config,
        )
        self._run.define_metric(STEP)
        self._run.define_metric("*", step_metric=STEP)
        self.log_dir = os.path.dirname(self._run.dir.rstrip("/"))  # the W&B run directory (files/ is in it)

    def step(self, rec: dict[str, Any]) -> None:
        """Log one metrics.jsonl line ``rec`` at its ``step``."""
        self._run.log({STEP: rec["step"], **scalars(rec)})

    def eval_loss(self, step: int, loss: float | None) -> None:
        """Log the held-out loss measured after ``step`` steps (0: before training); None: none held out."""
        if loss is not None:
            self._run.log({STEP: step, EVAL_TAG: loss})

    def __enter__(self) -> WandbLog:
        return self

    def __exit__(self, *exc: object) -> None:
        """Finish the W&B run (exit code 1 when the run stopped with an error), syncing what it logged."""
        self._run.finish(exit_code=1 if exc and exc[0] is not None else 0)
