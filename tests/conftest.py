"""Shared fixtures: GPU skipping, real small filesystems (tmpfs/ramfs) for disk-full and O_DIRECT tests,
and ``--cpu-async`` (the asynchronous CPU backend for the whole session)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest
import torch

from fuyou.device.precision import AUTO_ENV, SLOW_FACTOR


@pytest.fixture(scope="session", autouse=True)
def fuyou_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One per-machine measurement cache (``$FUYOU_CACHE``) for the whole session, away from the user's:
    the first test that needs the bf16 probe or a quick profile measures it, the rest reuse it."""
    old = os.environ.get("FUYOU_CACHE")
    path = str(tmp_path_factory.mktemp("fuyou-cache"))
    os.environ["FUYOU_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("FUYOU_CACHE", None)
    else:
        os.environ["FUYOU_CACHE"] = old


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-async",
        choices=["arena", "resize"],
        default=None,
        help="run the CPU backend in its asynchronous test mode (FUYOU_CPU_ASYNC: copies on worker threads "
        "after random delays, released memory poisoned; see fuyou/device/cpu_async.py); resize: free and "
        "restore device memory by storage resize, as the CUDA backend does",
    )

    parser.addoption(
        "--auto-precision",
        choices=["bf16", "fp32"],
        default=None,
        help="what --precision auto resolves to for the whole session (FUYOU_AUTO_PRECISION, inherited by the "
        "CLI runs and child processes): run the suite as the other kind of CPU would — AVX-512 BF16/AMX "
        "machines resolve auto to bf16, AVX2-only ones to fp32",
    )


def pytest_configure(config: pytest.Config) -> None:
    """``--cpu-async``: every ``get_backend("cpu")`` of the session is the asynchronous CPU backend;
    ``--auto-precision``: what ``--precision auto`` resolves to."""
    mode = config.getoption("--cpu-async")
    if mode:
        os.environ["FUYOU_CPU_ASYNC"] = mode
    auto = config.getoption("--auto-precision")
    if auto:
        os.environ[AUTO_ENV] = auto


def pytest_report_header(config: pytest.Config) -> list[str]:
    mode = os.environ.get("FUYOU_CPU_ASYNC", "")
    lines = [f"CPU backend: asynchronous test mode (FUYOU_CPU_ASYNC={mode})"] if mode not in ("", "0") else []
    auto = os.environ.get(AUTO_ENV) or _measured_auto()
    return lines + [f"--precision auto resolves to {auto} in this session"]


def _measured_auto() -> str:
    """What ``--precision auto`` picks on this machine (the probe, about a second at worst)."""
    from fuyou.device import get_backend
    from fuyou.device.precision import measure_bf16_slowdown

    return "fp32" if measure_bf16_slowdown(get_backend("cpu")) > SLOW_FACTOR else "bf16"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip @pytest.mark.gpu tests cleanly when no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def mounted(path: str, fstype: str, options: str = "") -> Iterator[str]:
    """Mount a fresh ``fstype`` at ``path`` for the block; skip the test if mounting is not allowed."""
    os.makedirs(path, exist_ok=True)
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, path]
    if os.geteuid() != 0 or subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip(f"cannot mount {fstype} here (needs root and mount permission)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


@pytest.fixture
def small_tmpfs(tmp_path: os.PathLike) -> Iterator[str]:
    """A real 8 MiB tmpfs: a disk that fills up."""
    with mounted(os.path.join(tmp_path, "small"), "tmpfs", "size=8m") as p:
        yield p


@pytest.fixture
def ramfs_dir(tmp_path: os.PathLike) -> Iterator[str]:
    """A real ramfs mount: a filesystem that refuses O_DIRECT."""
    with mounted(os.path.join(tmp_path, "ramfs"), "ramfs") as p:
        yield p


@pytest.fixture
def readonly_dir(tmp_path: os.PathLike) -> Iterator[str]:
    """A directory nobody (root included) can write to: a read-only tmpfs mount, or chmod 0500."""
    if os.geteuid() != 0:
        p = os.path.join(tmp_path, "ro")
        os.makedirs(p)
        os.chmod(p, 0o500)
        yield p
        os.chmod(p, 0o700)
        return
    with mounted(os.path.join(tmp_path, "ro"), "tmpfs", "size=1m,ro") as p:
        yield p
