"""What the store's I/O costs compute on the cpu device: a decoder layer's forward + backward alone and
beside a continuous stream of store reads and writes, side by side, paired rounds.

The cost model (``graph.StepGraph._ssd``) charges the I/O path's CPU time (``io_cpu_s_per_byte``, the
quick profile's figure: process CPU ÷ bytes moved by the store alone) to the cores' one server whole: a
second of I/O CPU stalls compute for a second, because torch splits each op evenly over every core and
waits for the slowest part. Figure: compute time lost ÷ that charge (1.0: the model holds; 1 ÷ cores:
the old charge, CPU time divided by the cores, would hold).

    python bench/bench_io_share.py --dir /work            # ~2 minutes on 2 cores
    python bench/bench_io_share.py --smoke --dir /tmp     # seconds; what the tests run
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, hardware_info  # noqa: E402


class IOStream:
    """A thread keeping the store busy: two extent reads and two extent writes in flight at a time, as
    the engine's weight reads and state writes overlap compute; counts the bytes moved."""

    def __init__(self, store: Any, names: list[str], bufs: list[Any], extent: int) -> None:
        self.store, self.names, self.bufs, self.extent = store, names, bufs, extent
        self.moved = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n, i = len(self.names), 0
        while not self._stop.is_set():
            fs = [self.store.read(self.names[(i + k) % n], self.bufs[(i + k) % n]) for k in range(2)]
            fs += [self.store.write(self.names[(i + 2 + k) % n], self.bufs[(i + 2 + k) % n]) for k in range(2)]
            for f in fs:
                f.result()
            self.moved += 4 * self.extent
            i += 4

    def __enter__(self) -> IOStream:
        self._thread.start()
        time.sleep(0.2)  # the stream at its steady rate before anything is timed
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.store.commit({})


def layer_s(config: Any, backend: Any, seq: int, repeats: int) -> float:
    """One decoder layer's forward + backward, seconds, timed as the quick profile times it."""
    from fuyou.planner.measure import block_compute

    pt, _ = block_compute(config, backend, 1, 1, seq, 1, repeats=repeats, precision="fp32")
    return seq / pt.fwd_flops_per_s + 2 * seq / pt.bwd_flops_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where the store goes (default: the temp dir)")
    ap.add_argument("--rounds", type=int, default=7, help="paired rounds after one warm-up")
    ap.add_argument("--extent-mib", type=int, default=16)
    ap.add_argument("--threads", type=int, default=16, help="the store's I/O threads (the engine's default)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from fuyou.device import get_backend, host_aligned_empty
    from fuyou.models.hf_io import load_config
    from fuyou.run.demo import demo_model_dir
    from fuyou.storage import ExtentSpec, TensorSpec, TensorStore

    rounds, extent, seq, reps = (1, 1 << 20, 64, 2) if a.smoke else (a.rounds, a.extent_mib << 20, 256, 5)
    config = load_config(demo_model_dir()[0])
    backend = get_backend("cpu", 8 << 30)
    work = tempfile.mkdtemp(prefix="fuyou-io-share-", dir=a.dir)
    names = [f"p{i}" for i in range(8)]
    bufs = [host_aligned_empty(extent) for _ in names]
    exts = [ExtentSpec(n, (TensorSpec("x", (extent,), torch.uint8),)) for n in names]
    try:
        with TensorStore.create([work], exts, io="auto", direct="auto", threads=a.threads, fsync=False) as store:
            for n, b in zip(names, bufs):
                store.write(n, b).result()
            store.commit({})
            with IOStream(store, names, bufs, extent) as io:  # the I/O path's CPU per byte, alone
                c0, m0 = time.process_time(), io.moved
                time.sleep(0.5 if a.smoke else 3.0)
                cpu_per_byte = (time.process_time() - c0) / max(1, io.moved - m0)
            layer_s(config, backend, seq, reps)  # warm-up
            rows = []
            for _ in range(rounds):
                alone = layer_s(config, backend, seq, reps)
                with IOStream(store, names, bufs, extent) as io:
                    m0, t0 = io.moved, time.perf_counter()
                    beside = layer_s(config, backend, seq, reps)
                    rate = (io.moved - m0) / (time.perf_counter() - t0)
                charged = rate * beside * cpu_per_byte  # I/O CPU seconds during one layer
                rows.append({"alone_ms": alone * 1e3, "beside_ms": beside * 1e3, "io_MBps": rate / 1e6,
                             "charged_ms": charged * 1e3, "lost_over_charged": (beside - alone) / charged})  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    emit(
        {
            "bench": "io_share",
            "smoke": a.smoke,
            "extent_bytes": extent,
            "io_threads": a.threads,
            "io_cpu_s_per_gb": cpu_per_byte * 1e9,
            "rounds": rows,
            "median": med,
            "model_charge": 1.0,
            "old_charge": 1 / (os.cpu_count() or 1),
            "hardware": hardware_info([os.path.dirname(work)]),
        },
        a.out,
    )


if __name__ == "__main__":
    main()
