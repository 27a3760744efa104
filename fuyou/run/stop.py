"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption notice).

The first signal asks the run to stop: the step in progress finishes, a checkpoint is written, and
the run raises ``RunInterrupted`` (the CLI prints the resume command and exits 128 + the signal
number: 130 for SIGINT, 143 for SIGTERM). A second SIGINT (Ctrl-C again) exits at once (``os._exit``);
a SIGTERM after the first signal does not, nor, under torchrun, a SIGINT within 2 s of the first
(torchrun's agent passes the terminal's Ctrl-C on to its workers, which the terminal already
signalled; it kills them itself if they take too long). The store's
commits and checkpoints are published by atomic renames, so whatever was in flight is unpublished
garbage that the next ``--resume auto`` ignores; nothing committed is lost.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from fuyou.errors import FuyouError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(FuyouError):
    """The run stopped on a signal after saving a checkpoint; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, signum: int, step: int, checkpoint: str | None, rank: int = 0) -> None:
        super().__init__(message)
        self.signum, self.step, self.checkpoint, self.rank = signum, step, checkpoint, rank

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by signal ``signum``: 128 + its number."""
        return 128 + self.signum


class StopRequest:
    """Context manager: while open, SIGINT and SIGTERM set ``signum`` instead of killing the process;
    a second SIGINT exits at once with 130. Outside the main thread (where Python cannot
    install handlers) it does nothing and the default behaviour stays."""

    def __init__(self, say: Any = None) -> None:
        self.signum: int | None = None
        self._first_at = 0.0
        self._say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived."""
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        echo = self.signum is not None and _forwarded(time.monotonic() - self._first_at)
        if self.signum is not None and signum == signal.SIGINT and not echo:
            self._say(f"{name} again: exiting at once (the last committed step and checkpoints are intact)")
            os._exit(128 + signum)
        if self.signum is not None:  # torchrun passes a Ctrl-C on (SIGINT, then SIGTERM): keep stopping cleanly
            self._say(f"{name} received while stopping: still finishing the step and saving the checkpoint")
            return
        self.signum, self._first_at = signum, time.monotonic()
        self._say(
            f"{name} received: finishing the current step, then saving a checkpoint and stopping "
            "(Ctrl-C again exits at once)"
        )


TORCHRUN_ECHO_S = 2.0
"""Under torchrun, a second SIGINT this soon after the first is torchrun's agent passing the terminal's
Ctrl-C on to its workers (which the terminal already sent them), not a second Ctrl-C."""


def _forwarded(since_first_s: float) -> bool:
    """Whether a repeated signal ``since_first_s`` seconds after the first is torchrun's forward of it."""
    return "TORCHELASTIC_RUN_ID" in os.environ and since_first_s < TORCHRUN_ECHO_S


def resume_command(argv: list[str]) -> str:
    """The ``fuyou`` command line ``argv`` (``sys.argv``) with ``--resume auto`` in place of any
    ``--resume`` and without ``--overwrite``, quoted for a POSIX shell."""
    import shlex

    out, skip = ["fuyou"], False
    for a in argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--resume":
            skip = True
            continue
        if a.startswith("--resume=") or a == "--overwrite":
            continue
        out.append(a)
    return shlex.join(out + ["--resume", "auto"])
