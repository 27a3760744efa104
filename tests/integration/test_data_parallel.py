"""Data-parallel ranks (gloo, local processes) train the same model as one process with the whole batch.

Each rank stores and updates its shard of every block (uneven with 3 ranks), gathers weights and
reduce-scatters gradients; per-step losses, gradient norms and final fp32 masters must match one
process over the same global batch within 1e-5, in both schedules, with clipping, accumulation and
RAM tiers, on the plain and the asynchronous CPU backend. Each rank moves about 1/N of the SSD bytes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.integration.test_engine_fidelity import zero_grad_part

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    spec: dict,
    world: int,
    d,
    env_extra: dict | None = None,
    timeout: float = 300,
    ranked: bool = False,
    killed: int | None = None,
) -> list:
    """Run ``dp_child`` as ``world`` local ranks (one plain process for world 1 unless ``ranked``); their results
    (None for rank ``killed``, which must die by SIGKILL). A second launch in ``d`` reuses its store."""
    d.mkdir(parents=True, exist_ok=True)
    ssd = d / "ssd"
    ssd.mkdir(exist_ok=True)
    path = d / "spec.json"
    path.write_text(json.dumps(dict(spec, ssd=str(ssd))))
    port, procs = free_port(), []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env |= env_extra or {}
        if world > 1 or ranked:
            env |= dict(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1")
            env |= dict(MASTER_PORT=str(port))
        cmd = [sys.executable, "-m", "tests.integration.dp_child", str(path), str(d / f"out{r}.pt")]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True))
    outs = []
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == (-9 if r == killed else 0), err[-3000:]
    for r in range(world):
        outs.append(None if r == killed else torch.load(d / f"out{r}.pt"))
    return outs


def assert_equivalent(one: dict, many: dict) -> None:
    assert many["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert many["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert many["weights"].keys() == one["weights"].keys()
    for k, ref in one["weights"].items():
        got, free = many["weights"][k], zero_grad_part(k, ref)
        torch.testing.assert_close(got[~free], ref[~free], rtol=1e-5, atol=1e-5, msg=k)


CASES = {
    # name: world, spec
    "2-clip": (2, dict(clip=1.0)),
    "3-noclip-accum": (3, dict(clip=0.0, K=2, schedule="overlap_backward")),
    "2-ramtier-clip-accum": (2, dict(clip=0.5, K=2, ram_weights=2, ram_state=2)),
    "3-tied-clip": (3, dict(clip=1.0, family="llama_tied", policy="recompute")),
    # frozen parameters in the layers' read-only extents, sharded unevenly and gathered; layer 0's in RAM
    "3-freeze-partial-ramtier": (3, dict(clip=1.0, freeze=["*.q_proj.weight", "*.mlp.up_proj.weight"], ram_weights=2)),
    # LoRA: the frozen base sharded and gathered, the adapters' gradients summed over ranks, clipping active
    "2-lora-clip-accum": (2, dict(clip=0.05, K=2, lora=4)),
    "3-lora": (3, dict(clip=1.0, lora=4, policy="recompute")),
    # the embedding and head in vocabulary groups, each gathered and reduce-scattered as a block
    "2-vocab-clip-accum": (2, dict(clip=1.0, K=2, vocab_groups=3, policy="recompute")),
}
SLOW = pytest.mark.slow  # ~25 s each; the default tier runs torchrun through the CLI (test_data_parallel_cli)


@SLOW
@pytest.mark.parametrize("case", list(CASES))
def test_ranks_train_what_one_process_trains(case: str, tmp_path) -> None:
    world, extra = CASES[case]
    spec = dict(steps=3, batch=2 * world * extra.get("K", 1), K=1, world=world) | extra
    (one,) = launch(spec, 1, tmp_path / "one")
    many = launch(spec, world, tmp_path / "many")
    assert_equivalent(one, many[0])
    for o in many:  # each rank reads and writes about its 1/N share (shards are padded to 32 elements;
        # a read that claims Adam's new weights in RAM instead of the SSD depends on timing)
        share = (o["ssd_read"] + o["ssd_written"]) / (one["ssd_read"] + one["ssd_written"])
        assert share < 1.25 / world, share
        assert o["comm"] > 0
    assert one["comm"] == 0


@SLOW
def test_ranks_keep_frozen_weights_exact_in_bf16(tmp_path) -> None:
    """An fp32 model computed in bf16 over 3 ranks: each rank keeps its shard of the frozen values in fp32
    (``o/`` extents, sharded like the weights), so the gathered masters of what never trains are exact."""
    freeze = ["model.embed_tokens.*", "*.q_proj.weight"]
    spec = dict(steps=2, batch=6, K=1, world=3, clip=1.0, precision="bf16", freeze=freeze)
    many = launch(spec, 3, tmp_path / "many")
    assert many[0]["frozen_exact"] and all(many[0]["frozen_exact"])


@SLOW
@pytest.mark.parametrize("mode", ["arena", "resize"])
def test_ranks_on_the_asynchronous_cpu_backend(mode: str, tmp_path) -> None:
    """The collectives' stream ordering, checked where a GPU would show its mistakes."""
    spec = dict(steps=2, batch=4, K=2, world=2, clip=1.0, policy="swap_ssd")
    (one,) = launch(spec, 1, tmp_path / "one")
    many = launch(spec, 2, tmp_path / "many", {"FUYOU_CPU_ASYNC": mode})
    assert_equivalent(one, many[0])


@SLOW
def test_resuming_ranks_whose_stores_are_steps_apart_is_refused_on_every_rank(tmp_path) -> None:
    spec = dict(steps=2, batch=4, K=1, world=2, clip=1.0, mismatch=True)
    outs = launch(spec, 2, tmp_path / "many")
    for o in outs:
        assert "left at different steps (1 to 2" in o["message"] and "--resume auto" in o["message"], o
        assert "cannot all go back to step 1" in o["message"], o


@SLOW
def test_a_token_id_outside_the_vocabulary_on_one_rank_stops_every_rank_before_the_step(tmp_path) -> None:
    spec = dict(steps=3, batch=4, K=1, world=2, clip=1.0, bad_id_rank=1)
    bad, other = reversed(launch(spec, 2, tmp_path / "many"))
    assert bad["error"].startswith("ConfigError: token id") and "outside the model's vocabulary" in bad["error"], bad
    assert other["error"].startswith("ConfigError: another rank's batch holds a token id"), other


@SLOW
def test_a_rank_killed_as_it_commits_leaves_stores_every_rank_resumes_from(tmp_path) -> None:
    """Rank 1 dies as it starts committing step 2, after rank 0 committed it: the stores are a step apart.
    Rank 0 kept step 1 until both confirmed, goes back to it, and the resumed run ends bit-identical to
    an uninterrupted one."""
    from fuyou.storage.dirs import rank_dirs
    from fuyou.storage.manifest import PREVIOUS, read_manifest

    spec = dict(steps=4, batch=4, K=1, world=2, clip=1.0)
    ref = launch(spec, 2, tmp_path / "ref")[0]
    d = tmp_path / "crash"
    stopped = launch(dict(spec, die={"rank": 1, "commit": 3}), 2, d, killed=1)[0]  # import, step 1, step 2
    assert "error" in stopped, stopped
    stores = [rank_dirs((str(d / "ssd"),), r, 2)[0] for r in range(2)]
    assert [read_manifest(s)["meta"]["step"] for s in stores] == [2, 1]
    assert read_manifest(stores[0], PREVIOUS)["meta"]["step"] == 1
    resumed = launch(dict(spec, resume_live=True), 2, d)
    assert [o["start"] for o in resumed] == [1, 1]
    assert any("went back from step 2 to step 1" in w for w in resumed[0]["warnings"]), resumed[0]["warnings"]
    assert resumed[0]["losses"] == ref["losses"][1:] and resumed[0]["norms"] == ref["norms"][1:]
    assert all(torch.equal(resumed[0]["weights"][k], v) for k, v in ref["weights"].items())


@SLOW
def test_one_rank_through_the_collectives_is_bit_identical_to_one_process(tmp_path) -> None:
    """``FUYOU_COLLECTIVES=1``: the data-parallel path at world size 1 (how one GPU checks NCCL's)."""
    spec = dict(steps=2, batch=4, K=2, world=1, clip=1.0)
    (one,) = launch(spec, 1, tmp_path / "one")
    (ranked,) = launch(spec, 1, tmp_path / "ranked", {"FUYOU_COLLECTIVES": "1"}, ranked=True)
    assert ranked["losses"] == one["losses"] and ranked["norms"] == one["norms"]
    assert all(torch.equal(ranked["weights"][k], v) for k, v in one["weights"].items())
    assert ranked["ranked"] and not one["ranked"]  # the first went through the collectives, the second not
    assert ranked["comm"] == 0 and ranked["ssd_written"] == one["ssd_written"]
