"""Child for the open-file-limit test: import a Hugging Face model directory into a store and train
a few steps, under whatever ``ulimit -n`` the parent gave it; print (JSON) the losses, each trained
tensor's squared norm, the number of extents and store files, and the most descriptors this process
held at once (sampled every 5 ms).

Usage: python -m tests.integration.nofile_child MODEL_DIR SSD_DIR STEPS STATE_CHUNK
"""

import json
import os
import resource
import sys
import threading

from fuyou.engine import Engine, EngineConfig, Plan
from tests.integration.tiny_models import batches

LR, WD = 1e-3, 0.01


class FdSampler:
    """Counts this process's open descriptors every few milliseconds, keeping the maximum."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            try:
                self.peak = max(self.peak, len(os.listdir("/proc/self/fd")))
            except OSError:  # listing needs a descriptor itself; at the limit, skip this sample
                pass

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def main() -> None:
    model_dir, ssd, steps, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    sampler = FdSampler()
    ec = EngineConfig(
        ssd_dirs=(ssd,),
        precision="fp32",
        lr=LR,
        weight_decay=WD,
        cpu_memory="512MiB",
        plan=Plan(prefetch_depth=2, state_chunk=chunk),
    )
    with Engine.from_pretrained(model_dir, ec) as eng:
        losses = [eng.train_step(ids, labels)["loss"] for ids, labels in batches(steps)]
        extents = len(eng.store.extents)
        weights = {k: float(v.double().square().sum()) for k, v in eng.master_weights()}
    files = sum(1 for f in os.listdir(ssd) if f.endswith(".fy"))
    print(
        json.dumps(
            {
                "losses": losses,
                "extents": extents,
                "store_files": files,
                "peak_fds": sampler.stop(),
                "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                "weights_sq": weights,
            }
        )
    )


if __name__ == "__main__":
    main()
