"""One rank of a data-parallel Fuyou run (or the one-process reference), for test_data_parallel.

    python -m tests.integration.dp_child SPEC.json OUT.pt      (RANK/WORLD_SIZE/MASTER_* from the launcher)

SPEC: device (default cpu), family, steps, batch (the global batch), seq, K (micro-batches per rank), clip, policy,
precision, ssd (a store path, may hold {rank}), cpu_memory, ram_weights, ram_state, moe_balance, expert_groups, mismatch (then
rank 1's store goes back one committed step and both ranks try ``Engine.resume``: each writes the
error it got). Writes on rank 0 (or the only process) the per-step losses, grad norms and final
master weights; every rank writes its SSD bytes.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.models.adapters import make_adapter
from tests.integration.tiny_models import batches, tiny


def main(spec_path: str, out: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cfg, model = tiny(spec.get("family", "llama"), layers=spec.get("layers", 2))
    groups = spec.get("expert_groups", 1)
    nblocks = len(make_adapter(cfg, expert_groups=groups).blocks)
    K = spec["K"] * (spec["world"] // world)  # the one-process reference runs every rank's micro-batches
    plan = Plan(
        grad_accum=K,
        prefetch_depth=2,
        activation_policy=("keep",) + (spec.get("policy", "keep"),) * (nblocks - 2) + ("keep",),
        ram_weight_blocks=spec.get("ram_weights", 0),
        ram_state_blocks=spec.get("ram_state", 0),
        schedule=spec.get("schedule", "auto"),
        expert_groups=groups,
    )
    ec = EngineConfig(
        ssd_dirs=(spec["ssd"],),
        device=spec.get("device", "cpu"),
        precision=spec.get("precision", "fp32"),
        lr=1e-3,
        weight_decay=0.01,
        cpu_memory=spec.get("cpu_memory", "256MiB"),
        max_grad_norm=spec.get("clip", 0.0),
        plan=plan,
        moe_balance=spec.get("moe_balance", "global"),
    )
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = batches(spec["steps"], batch=spec["batch"], seq=spec.get("seq", 16))
    losses, norms, read, written, comm = [], [], 0, 0, 0
    eng = Engine.from_state_dict(cfg, sd, ec)
    for ids, labels in data:
        per = ids.shape[0] // world
        st = eng.train_step(ids[rank * per : (rank + 1) * per], labels[rank * per : (rank + 1) * per])
        losses.append(st.loss)
        norms.append(st.grad_norm)
        read, written, comm = read + st.ssd_read_bytes, written + st.ssd_write_bytes, comm + st.comm_bytes
    weights = dict(eng.master_weights())
    eng.close()
    if spec.get("mismatch"):  # rank 1's live store goes back a step: resuming must refuse on every rank
        _resume_mismatched(ec, rank, out)
        return
    result = {"ssd_read": read, "ssd_written": written, "comm": comm, "rank": rank, "ranked": eng.comm is not None}
    if rank == 0:
        result |= {"losses": losses, "norms": norms, "weights": weights}
    torch.save(result, out)


def _resume_mismatched(ec: EngineConfig, rank: int, out: str) -> None:
    from fuyou.errors import ConfigError
    from fuyou.storage.dirs import rank_dirs
    from fuyou.storage.store import TensorStore

    if rank == 1:
        with TensorStore.open(rank_dirs(ec.ssd_dirs, 1, 2)) as st:
            st.commit(dict(st.meta, step=st.meta["step"] - 1))
    try:
        Engine.resume(ec).close()
        message = "resumed"
    except ConfigError as e:
        message = str(e)
    torch.save({"message": message, "rank": rank}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
