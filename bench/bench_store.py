"""P3 — store throughput vs fio on the same directory, side by side in one run.

Sequential write and read of ≥ 1 GiB through ``TensorStore`` (extents of ``--extent-mib`` written
and read concurrently from pre-allocated host buffers, O_DIRECT) against
``fio --direct=1 --bs=1M`` (libaio; io_uring or posixaio where the fio at hand lacks it: the line's
``fio_engine``) on the same directory, at ``--iodepth=8`` and at the
store's own queue depth (``--threads`` 1 MiB blocks in flight: ``ratio_store_qd``). Repeats are
interleaved (fio, store, fio, store, …) so drift hits both alike; medians of ``--repeats`` after a
warm-up. Prints one JSON line per figure (see bench/common.py).

``--io`` names the store's I/O engines to measure (``posix``, ``kvikio``, ``pyfile``; a comma list),
each over its own store in the same directory, interleaved with fio in every repeat. Each engine gets
its GB/s and its CPU-seconds per GB moved (the process's CPU time during its reads or writes, all
threads, checksums included), side by side with the other engines and fio.

    python bench/bench_store.py --dir /mnt/nvme/bench           # full run (1 GiB, 5 repeats)
    python bench/bench_store.py --dir /mnt/nvme/bench --io posix,kvikio   # on a CUDA machine
    python bench/bench_store.py --smoke                         # seconds; what the tests run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import emit, hardware_info  # noqa: E402
from fuyou.device import get_backend  # noqa: E402
from fuyou.storage import ExtentSpec, TensorSpec, TensorStore  # noqa: E402
from fuyou.transfer.host_pool import HostBufferPool  # noqa: E402

FIO_ENGINES = ("libaio", "io_uring", "posixaio")
"""fio's asynchronous engines in the order tried: a fio built without libaio (a static build carried to
a machine whose image has no fio) still has io_uring or POSIX AIO."""


class Fio:
    """fio on one directory, with the first of ``FIO_ENGINES`` this fio lists (``fio --enghelp``) and
    that runs: an engine that fails is dropped and the next one tried (raises the last failure if none
    runs)."""

    def __init__(self, directory: str) -> None:
        listed = subprocess.run(["fio", "--enghelp"], capture_output=True, text=True).stdout.split()
        self.directory = directory
        self.engines = [e for e in FIO_ENGINES if e in listed] or list(FIO_ENGINES)

    @property
    def engine(self) -> str:
        return self.engines[0]

    def __call__(self, rw: str, size_mib: int, iodepth: int = 8) -> float:
        """One fio run (O_DIRECT, 1 MiB blocks, ``iodepth`` in flight): bytes/s."""
        while True:
            try:
                return fio(self.directory, rw, size_mib, iodepth, self.engine)
            except subprocess.CalledProcessError:
                if len(self.engines) == 1:
                    raise
                print(f"fio: engine {self.engines.pop(0)} failed here; trying {self.engine}", file=sys.stderr)


def fio(directory: str, rw: str, size_mib: int, iodepth: int = 8, engine: str = "libaio") -> float:
    """Run fio once (O_DIRECT, 1 MiB blocks, ``engine`` at ``iodepth``) and return bytes/s."""
    cmd = [
        "fio",
        "--name=fuyou-bench",
        f"--directory={directory}",
        f"--rw={rw}",
        "--bs=1M",
        f"--iodepth={iodepth}",
        "--direct=1",
        f"--ioengine={engine}",
        f"--size={size_mib}M",
        "--numjobs=1",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"])


def store_run(store: TensorStore, names: list[str], bufs: list[torch.Tensor], op: str) -> tuple[float, float]:
    """Write (or read) every extent concurrently; return (bytes/s, process CPU-seconds per GB) —
    commit excluded, timed apart."""
    total = sum(store.spec(n).nbytes for n in names)
    c0, t0 = time.process_time(), time.perf_counter()
    futs = [getattr(store, op)(n, b) for n, b in zip(names, bufs)]
    for f in futs:
        f.result()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return total / dt, cpu / (total / 1e9)


def engines(arg: str) -> list[str]:
    """The I/O engines of ``--io`` (comma list), each checked usable here; exits with one line if not."""
    from fuyou.storage.io_kvikio import kvikio_usable
    from fuyou.storage.io_select import IO_BACKENDS

    out = [e.strip() for e in arg.split(",") if e.strip()]
    bad = [e for e in out if e not in IO_BACKENDS]
    if bad or not out:
        sys.exit(f"--io: unknown I/O engine {bad or arg!r}; choose from {', '.join(IO_BACKENDS)}")
    if "kvikio" in out and not kvikio_usable():
        sys.exit("--io kvikio: kvikio cannot do I/O here (it needs the kvikio package and a CUDA driver, "
                 "libcuda.so.1); measure it on a CUDA machine, or leave it out of --io")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dir", default=None, help="directory on the disk to measure (default: a temp dir in /work or /tmp)"
    )
    ap.add_argument("--size-mib", type=int, default=1024, help="bytes moved per repeat (MiB)")
    ap.add_argument("--extent-mib", type=int, default=64, help="size of one extent (MiB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--block-kib", type=int, default=1024, help="store I/O block size (KiB)")
    ap.add_argument("--io", default="posix", help="I/O engines to measure, a comma list of posix, kvikio, pyfile")
    ap.add_argument("--smoke", action="store_true", help="64 MiB, 1 repeat; fio skipped if absent")
    ap.add_argument(
        "--no-fio", action="store_true", help="no fio reference (a machine without it): engines side by side only"
    )
    ap.add_argument(
        "--direct", choices=["on", "auto", "off"], default="on",
        help="O_DIRECT for the stores: on (default: refuse a filesystem without it), auto (buffered there), off",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="also append JSON lines to this file")
    a = ap.parse_args()
    a.engines = engines(a.io)
    if a.smoke:
        a.size_mib, a.extent_mib, a.repeats = 64, 16, 1
    base = a.dir or ("/work" if os.path.isdir("/work") else tempfile.gettempdir())
    work = tempfile.mkdtemp(prefix="fuyou-bench-store-", dir=base)
    try:
        run(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(a: argparse.Namespace, work: str) -> None:
    n_ext = max(1, a.size_mib // a.extent_mib)
    numel = a.extent_mib << 18  # fp32 elements per extent
    extents = [ExtentSpec(f"layer{i}", (TensorSpec("w", (numel,), torch.float32),)) for i in range(n_ext)]
    fdir = os.path.join(work, "fio")
    os.makedirs(fdir)
    pool = HostBufferPool(get_backend("cpu"), budget=(n_ext + 1) * (a.extent_mib << 20))
    pool.reserve("extent", a.extent_mib << 20, n_ext)
    bufs = [pool.acquire("extent").data for _ in range(n_ext)]
    for b in bufs:
        b.view(torch.float32).normal_()
    have_fio = shutil.which("fio") is not None and not a.no_fio
    ref = Fio(fdir) if have_fio else None
    if not have_fio and not (a.smoke or a.no_fio):
        sys.exit(
            "fio is not installed (apt-get install fio); it is the reference this benchmark compares against "
            "(--no-fio compares the store's engines only)"
        )
    stores = {}
    for io in a.engines:
        sdir = os.path.join(work, f"store-{io}")
        os.makedirs(sdir)
        stores[io] = TensorStore.create(
            [sdir], extents, io=io, direct=a.direct, threads=a.threads, block_bytes=a.block_kib << 10
        )
    names = [e.name for e in extents]
    keys = ["fio_write", "fio_read", "fioqd_write", "fioqd_read"]
    keys += [f"{io}_{k}" for io in a.engines for k in ("write", "read", "write_cpu", "read_cpu", "commit_s")]
    res: dict[str, list[float]] = {k: [] for k in keys}
    try:
        for rep in range(a.repeats + 2):  # repeats 0 and 1 are warm-up: after them writes recycle files, as in training
            row: dict[str, float] = {}
            for io, store in stores.items():
                row[f"{io}_write"], row[f"{io}_write_cpu"] = store_run(store, names, bufs, "write")
                t0 = time.perf_counter()
                store.commit({"rep": rep})
                row[f"{io}_commit_s"] = time.perf_counter() - t0
                row[f"{io}_read"], row[f"{io}_read_cpu"] = store_run(store, names, bufs, "read")
            for k, rw, qd in (
                ("fio", "write", 8),
                ("fio", "read", 8),
                ("fioqd", "write", a.threads),
                ("fioqd", "read", a.threads),
            ):
                row[f"{k}_{rw}"] = ref(rw, a.size_mib, qd) if ref is not None else float("nan")
            if rep >= 2:
                for k, v in row.items():
                    res[k].append(v)
    finally:
        for store in stores.values():
            store.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    common = {
        "bench": "store_vs_fio",
        "smoke": a.smoke,
        "size_mib": a.size_mib,
        "extent_mib": a.extent_mib,
        "threads": a.threads,
        "block_kib": a.block_kib,
        "repeats": a.repeats,
        "fio_engine": ref.engine if ref is not None else None,
        "hardware": hardware_info([work]),
    }
    for io in a.engines:
        for op in ("write", "read"):
            emit(
                {
                    **common,
                    "io": io,
                    "op": op,
                    "o_direct": stores[io].direct,
                    "store_GBps": med[f"{io}_{op}"] / 1e9,
                    "store_cpu_s_per_GB": med[f"{io}_{op}_cpu"],
                    "fio_GBps": med[f"fio_{op}"] / 1e9,
                    "ratio": med[f"{io}_{op}"] / med[f"fio_{op}"],
                    "store_all_GBps": [x / 1e9 for x in res[f"{io}_{op}"]],
                    "fio_all_GBps": [x / 1e9 for x in res[f"fio_{op}"]],
                    "fio_store_qd": a.threads,
                    "fio_store_qd_GBps": med[f"fioqd_{op}"] / 1e9,
                    "ratio_store_qd": med[f"{io}_{op}"] / med[f"fioqd_{op}"],
                    **(
                        {}
                        if io == a.engines[0]
                        else {f"ratio_vs_{a.engines[0]}": med[f"{io}_{op}"] / med[f"{a.engines[0]}_{op}"]}
                    ),
                },
                a.out,
            )
        emit({**common, "io": io, "op": "commit", "commit_s_median": med[f"{io}_commit_s"]}, a.out)


if __name__ == "__main__":
    main()
