"""``--report-to``: where a run's metrics go besides ``metrics.jsonl`` — TensorBoard
(``fuyou.run.tensorboard``), Weights & Biases (``fuyou.run.wandb_log``), both, or neither."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from fuyou.errors import ConfigError

REPORT_TO = ("none", "tensorboard", "wandb")
"""The values of ``--report-to``; several join with commas (``tensorboard,wandb``)."""


def parse(value: str | list | tuple) -> tuple[str, ...]:
    """``--report-to`` as the integrations it names (``none``: ()). Raises ConfigError for an unknown one."""
    parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
    names = tuple(dict.fromkeys(str(p).strip() for p in parts if str(p).strip()))
    bad = [n for n in names if n not in REPORT_TO]
    if bad or not names:
        raise ConfigError(f"--report-to must be one or more of {', '.join(REPORT_TO)}, got {value!r}")
    return tuple(n for n in names if n != "none")


def require(names: tuple[str, ...]) -> None:
    """Check that every integration in ``names`` can start (its package is there); raises ConfigError."""
    from fuyou.run.tensorboard import require_tensorboard
    from fuyou.run.wandb_log import require_wandb

    for name in names:
        {"tensorboard": require_tensorboard, "wandb": require_wandb}[name]()


class Reporters:
    """The run's open integrations, each given every step record and held-out loss."""

    def __init__(self, logs: list[Any]) -> None:
        self.logs = logs

    def step(self, rec: dict[str, Any]) -> None:
        for log in self.logs:
            log.step(rec)

    def eval_loss(self, step: int, loss: float | None) -> None:
        for log in self.logs:
            log.eval_loss(step, loss)

    def dir_of(self, kind: type[Any]) -> str | None:
        """The log directory of the open integration of class ``kind``, or None."""
        return next((log.log_dir for log in self.logs if isinstance(log, kind)), None)


@contextlib.contextmanager
def open_reporters(names: tuple[str, ...], run_dir: str, resumed_from: int, config: dict) -> Iterator[Reporters]:
    """Open the integrations ``names`` for the run in ``run_dir`` (``resumed_from``: the step a resume
    starts after, 0 for a fresh start; ``config``: the run's settings for W&B); close them on exit."""
    from fuyou.run.tensorboard import TensorBoardLog
    from fuyou.run.wandb_log import WandbLog

    with contextlib.ExitStack() as stack:
        logs: list[Any] = []
        for name in names:
            if name == "tensorboard":
                logs.append(stack.enter_context(TensorBoardLog(run_dir, resumed_from)))
            else:
                logs.append(stack.enter_context(WandbLog(run_dir, config, resumed=resumed_from > 0)))
        yield Reporters(logs)
