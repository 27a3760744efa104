"""Environment checks run by ``fuyou doctor`` (and at the start of a run): can this machine train?

Each check returns a ``Check``: name, status (ok / warn / fail), and a one-line detail with the fix.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from dataclasses import dataclass

from fuyou.errors import StoreDirError
from fuyou.units import format_size


@dataclass(frozen=True)
class Check:
    """One environment check: ``status`` is ``ok``, ``warn`` or ``fail``."""

    name: str
    status: str
    detail: str


def _fstype(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, check=True).stdout
        return out.splitlines()[-1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def check_ssd_dir(path: str) -> list[Check]:
    """Writable, O_DIRECT, free space and filesystem of one store directory."""
    from fuyou.storage.dirs import check_dir, direct_supported

    try:
        path = check_dir(path)
    except StoreDirError as e:
        return [Check(f"ssd {path}", "fail", str(e))]
    usage = shutil.disk_usage(path)
    checks = [
        Check(
            f"ssd {path}",
            "ok",
            f"writable, {_fstype(path)}, {format_size(usage.free)} free of {format_size(usage.total)}",
        )
    ]
    if direct_supported(path):
        checks.append(Check(f"O_DIRECT {path}", "ok", "works (page cache bypassed)"))
    else:
        checks.append(
            Check(
                f"O_DIRECT {path}",
                "warn",
                "refused by this filesystem: buffered I/O will be used "
                "(eats RAM, slower); prefer ext4 or xfs on the SSD",
            )
        )
    return checks


def check_memlock() -> Check:
    """The locked-memory limit bounds pinned host buffers (root and CAP_IPC_LOCK are exempt): on a GPU
    the weight and gradient buffers, those that cross PCIe (``fuyou.schedule.sizing.crosses_pcie``);
    optimizer state and the RAM tier stay pageable and do not count."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or os.geteuid() == 0:
        return Check("memlock", "ok", "unlimited" if soft == resource.RLIM_INFINITY else "root: not limited")
    return Check(
        "memlock",
        "warn",
        f"ulimit -l is {format_size(soft)}: pinning the weight and gradient buffers may fail on a GPU; "
        "raise it (ulimit -l unlimited, or memlock in /etc/security/limits.conf)",
    )


def check_open_files() -> Check:
    """The open-file limit: the store keeps at most a quarter of it open, whatever the model size."""
    from fuyou.storage.open_files import default_capacity

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    cap = default_capacity(16)
    if soft != resource.RLIM_INFINITY and soft < 256:
        return Check(
            "open files",
            "warn",
            f"ulimit -n is {shown}: the store keeps up to {cap} files open and "
            "imports and checks need more; raise it (ulimit -n 4096)",
        )
    return Check(
        "open files", "ok", f"ulimit -n {shown}: the store keeps at most {cap} files open (more are reopened on demand)"
    )


def check_gpu() -> list[Check]:
    """GPU visibility and kvikio availability (file I/O through host buffers; not GPUDirect Storage)."""
    from fuyou.device import cuda
    from fuyou.storage.io_kvikio import kvikio_usable

    gpu = cuda.describe()
    checks = [Check("gpu", "ok" if gpu else "warn", gpu or "no CUDA GPU visible: training runs on the CPU backend")]
    if kvikio_usable():
        checks.append(
            Check(
                "kvikio",
                "ok",
                "usable, not used by default: store I/O goes through the POSIX O_DIRECT "
                "thread pool (kvikio is not yet measured faster); FUYOU_IO=kvikio or "
                "io='kvikio' selects it",
            )
        )
    else:
        checks.append(
            Check(
                "kvikio",
                "ok",
                "not usable (no CUDA driver or package); not needed: store I/O goes "
                "through the POSIX O_DIRECT thread pool"
                + ("; pip install 'fuyou[cu12]' to try kvikio (FUYOU_IO=kvikio)" if gpu else ""),
            )
        )
    return checks


def check_threading_layer() -> Check:
    """The threading layer numba runs the CPU Adam's kernels on (launching one small kernel to choose it).

    ``tbb`` (the dependency on x86-64) is ok. ``omp`` warns: its team in the Adam thread beside torch's makes
    libgomp's workers sleep between parallel regions, and every small op of the training thread waits for
    one to wake (``fuyou.device.host_threads``: element-wise ops 5–10× slower on a 2-core VM). ``workqueue``
    warns: the Adam and gradient-norm kernels then run one at a time (``fuyou.optim.parallel``)."""
    import torch

    from fuyou.optim.norm import sum_squares
    from fuyou.optim.parallel import threading_layer

    sum_squares(torch.zeros(1 << 17))
    layer = threading_layer() or "unknown"
    if layer == "tbb":
        return Check("numba layer", "ok", "tbb: the CPU Adam's threads leave torch's OpenMP threads spinning")
    fix = "pip install tbb (x86-64 wheels), or NUMBA_THREADING_LAYER=tbb where TBB is installed otherwise"
    if layer == "omp":
        return Check(
            "numba layer", "warn",
            f"omp: the CPU Adam's OpenMP team beside torch's slows the training thread's small ops; {fix}",
        )  # fmt: skip
    return Check("numba layer", "warn", f"{layer}: the Adam and gradient-norm kernels run one at a time; {fix}")


def run_checks(ssd_dirs: list[str]) -> list[Check]:
    """All checks for the given store directories."""
    checks: list[Check] = []
    for d in ssd_dirs:
        checks += check_ssd_dir(d)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    checks.append(Check("host", "ok", f"{os.cpu_count()} cores, {format_size(ram)} RAM"))
    checks.append(check_memlock())
    checks.append(check_open_files())
    checks += check_gpu()
    checks.append(check_threading_layer())
    return checks
