"""A sharded ModelLayout: every rank's shard, put together in rank order, is the one-rank layout."""

from __future__ import annotations

import pytest
import torch

from fuyou.errors import ConfigError
from fuyou.models.adapters import make_adapter
from fuyou.models.store_layout import ModelLayout
from fuyou.storage.dirs import rank_dirs
from tests.integration.tiny_models import tiny


@pytest.mark.parametrize("world", [2, 3, 5])
def test_shards_put_together_are_the_whole_block(world: int) -> None:
    cfg, model = tiny("llama_tied", layers=1)
    blocks = tuple(make_adapter(cfg).blocks)
    sd = model.state_dict()
    one = ModelLayout(blocks, torch.float32, state_chunk=64)
    no_decay = frozenset(k for k in sd if k.endswith("norm.weight"))
    for b, blk in enumerate(blocks):
        src = {p.key: sd[p.key] for p in blk.params}
        whole = torch.empty(one.numel(b))
        one.flatten_into(b, src, whole, 0, one.numel(b))
        parts, decay = [], torch.zeros(0, dtype=torch.bool)
        for r in range(world):
            lay = ModelLayout(blocks, torch.float32, state_chunk=64, rank=r, world=world)
            assert lay.full_numel(b) == world * lay.numel(b) >= one.numel(b)
            assert lay.w(b).nbytes == 4 * lay.numel(b) and [t.name for t in lay.w(b).tensors] == ["shard"]
            part = torch.empty(lay.numel(b))
            for lo, hi in lay.chunks(b):  # chunk by chunk, as the import does
                lay.flatten_into(b, src, part[lo:hi], lo, hi)
            parts.append(part)
            d = torch.zeros(lay.numel(b), dtype=torch.bool)
            runs = lay.decay_runs(b, no_decay)
            assert runs[0][0] == 0 and runs[-1][1] == lay.numel(b)
            for lo, hi, dec in runs:
                d[lo:hi] = dec
            decay = torch.cat([decay, d])
        gathered = torch.cat(parts)
        assert torch.equal(gathered[: one.numel(b)], whole) and not gathered[one.numel(b) :].any()
        want = torch.ones(world * parts[0].numel(), dtype=torch.bool)
        for lo, hi, dec in one.decay_runs(b, no_decay):
            want[lo:hi] = dec
        assert torch.equal(decay, want)
        views = lay.unflatten(b, gathered)
        for k, t in views.items():
            assert torch.equal(t, src[k].float())


def test_a_rank_outside_the_world_is_refused() -> None:
    cfg, _ = tiny("llama", layers=1)
    with pytest.raises(ConfigError, match="rank 2 of world size 2"):
        ModelLayout(tuple(make_adapter(cfg).blocks), rank=2, world=2)


def test_rank_dirs(tmp_path) -> None:
    assert rank_dirs(["/a", "/b"], 0, 1) == ["/a", "/b"]
    assert rank_dirs(["/nvme{local_rank}/x{rank}"], 0, 1) == ["/nvme0/x0"]
    assert rank_dirs(["/nvme{local_rank}/run-{rank}"], 5, 8, local_rank=1) == ["/nvme1/run-5"]
    got = rank_dirs([str(tmp_path)], 1, 2)
    assert got == [str(tmp_path / "rank1")] and (tmp_path / "rank1").is_dir()
    assert rank_dirs([str(tmp_path / "missing")], 0, 2) == [str(tmp_path / "missing" / "rank0")]
    assert not (tmp_path / "missing").exists()
