"""The I/O backends every store-level test runs under: POSIX, the non-descriptor ``pyfile`` engine
(the CPU stand-in for kvikio's handles), and kvikio where it is usable (a CUDA driver)."""

from __future__ import annotations

import pytest

from fuyou.storage.io_kvikio import kvikio_usable
from fuyou.storage.io_select import IO_ENV


def engines_under_test() -> list[str]:
    """Engine names for ``io=`` / ``$FUYOU_IO``: posix, pyfile, and kvikio when usable."""
    return ["posix", "pyfile"] + (["kvikio"] if kvikio_usable() else [])


def engines_posix_first() -> list:
    """``engines_under_test`` for tests too slow to run thrice in the default tier: POSIX there, the
    other backends in the ``slow`` tier (which ``.ci/run`` also runs)."""
    return [kind if kind == "posix" else pytest.param(kind, marks=pytest.mark.slow) for kind in engines_under_test()]


def use_engine(monkeypatch: pytest.MonkeyPatch, kind: str) -> str:
    """Make ``io="auto"`` mean ``kind`` for the test (and its child processes); returns ``kind``."""
    monkeypatch.setenv(IO_ENV, kind)
    return kind
