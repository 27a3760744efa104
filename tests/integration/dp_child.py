"""One rank of a data-parallel Fuyou run (or the one-process reference), for test_data_parallel.

    python -m tests.integration.dp_child SPEC.json OUT.pt      (RANK/WORLD_SIZE/MASTER_* from the launcher)

SPEC: device (default cpu), family, steps, batch (the global batch), seq, K (micro-batches per rank), clip, policy,
precision, ssd (a store path, may hold {rank}), cpu_memory, ram_weights, ram_state, moe_balance, expert_groups, vocab_groups, freeze, lora (a rank: LoRA on every linear layer), mismatch (then
rank 1's store goes back one committed step and both ranks try ``Engine.resume``: each writes the
error it got), die ({"rank": r, "commit": k}: rank r is SIGKILLed as it starts its k-th store commit; the
others write the error that stopped them), resume_live (resume every rank's live store with
``Engine.resume`` and train the steps left), bad_id_rank (that rank's second batch holds an id outside the
vocabulary: every rank writes the error that stopped it). Writes on rank 0 (or the only process) the per-step losses, grad norms and final
master weights; every rank writes its SSD bytes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings

import torch

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.engine.lora import LoraState
from fuyou.models.adapters import make_adapter
from fuyou.models.lora import LoraSettings
from fuyou.transfer.collectives import OneRank
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
        vocab_groups=spec.get("vocab_groups", 1),
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
        freeze=tuple(spec.get("freeze", ())),
        lora=None if "lora" not in spec else LoraSettings(rank=spec["lora"], alpha=2 * spec["lora"]),
    )
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = batches(spec["steps"], batch=spec["batch"], seq=spec.get("seq", 16))
    losses, norms, read, written, comm = [], [], 0, 0, 0
    die = spec.get("die")
    if die and die["rank"] == rank:
        _die_at_commit(die["commit"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = Engine.resume(ec) if spec.get("resume_live") else Engine.from_state_dict(cfg, sd, ec)
    start = eng.progress.step
    steps = []
    for ids, labels in data[start:]:
        per = ids.shape[0] // world
        mine = ids[rank * per : (rank + 1) * per]
        if spec.get("bad_id_rank") == rank and eng.progress.step == 1:  # data from another tokenizer
            mine = mine.clone()
            mine[0, -1] = cfg.vocab_size
        try:
            st = eng.train_step(mine, labels[rank * per : (rank + 1) * per])
        except Exception as e:  # noqa: BLE001 - a peer was killed: record what stopped this rank, then exit
            torch.save({"error": f"{type(e).__name__}: {e}", "rank": rank}, out)
            os._exit(0)
        losses.append(st.loss)
        norms.append(st.grad_norm)
        steps.append(st)
    for st in steps:  # each step's bytes, its update's included (read after the steps: the overlap kept)
        read, written, comm = read + st.ssd_read_bytes, written + st.ssd_write_bytes, comm + st.comm_bytes
    weights = dict(eng.master_weights())
    if isinstance(eng.lora, LoraState):  # the adapters (the same on every rank), beside the frozen base
        weights |= {k: v.detach().cpu().clone() for k, v in eng.lora.params.items()}
    eng.close()
    if spec.get("mismatch"):  # rank 1's live store goes back a step: resuming must refuse on every rank
        _resume_mismatched(ec, rank, out)
        return
    result = {
        "ssd_read": read,
        "ssd_written": written,
        "comm": comm,
        "rank": rank,
        "ranked": not isinstance(eng.comm, OneRank),
    }
    result |= {"start": start, "warnings": [str(w.message) for w in caught]}
    if rank == 0:
        result |= {"losses": losses, "norms": norms, "weights": weights}
        result["frozen_exact"] = [torch.equal(weights[k], sd[k]) for k in eng.adapter.frozen_keys | _whole(eng)]
    torch.save(result, out)


def _whole(eng: Engine) -> set[str]:
    """Keys of the parameters of the blocks ``--freeze`` froze whole."""
    return {p.key for b in eng.layout.frozen_blocks for p in eng.layout.blocks[b].params}


def _die_at_commit(k: int) -> None:
    """SIGKILL this process as it starts its ``k``-th store commit (counting the import's)."""
    from fuyou.storage.store import TensorStore

    real, count = TensorStore.commit, [0]

    def commit(self: TensorStore, meta: dict | None = None, agree=None) -> int:  # noqa: ANN001
        count[0] += 1
        if count[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, meta, agree)

    TensorStore.commit = commit  # type: ignore[method-assign]


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
