import os

import pytest
import torch

from fuyou.checkpoint import list_checkpoints, prune, restore, take, validate
from fuyou.checkpoint.resume import resume_point
from fuyou.checkpoint.snapshot import CKPT, disk_usage
from fuyou.errors import ChecksumError, ConfigError, FuyouWarning, StoreError
from fuyou.storage import TensorStore
from tests.io_engines import engines_under_test, use_engine
from tests.unit.checkpoint.helpers import make_store

N = 200_000


@pytest.fixture(autouse=True, params=engines_under_test())
def io_engine(request, monkeypatch):
    """Every test here runs once per I/O backend: each store it creates or opens uses that engine."""
    return use_engine(monkeypatch, request.param)


def make(tmp_path, ndirs=2):
    return make_store(tmp_path, N, ndirs)


def fill(st, v):
    for e in st.extents:
        st.write(e.name, torch.full((N,), float(v)))
    return st.commit({"v": v})


def values(st):
    out = []
    for e in st.extents:
        buf = torch.empty(N)
        st.read(e.name, buf).result()
        out.append(buf[0].item())
    return out


def test_checkpoint_is_links_and_survives_later_commits(tmp_path, io_engine):
    st, _ = make(tmp_path)
    assert st.io.name == io_engine
    fill(st, 1)
    info = take(st, "a", {"step": 1})
    assert info["files"] == 6 and info["stall_s"] < 1.0
    one = disk_usage(st.dirs)
    for v in (2, 3, 4):  # later commits must unlink, not recycle, the checkpointed files
        fill(st, v)
    assert values(st) == [4.0] * 3
    assert validate(st.dirs, "a") == {"step": 1}
    ck = TensorStore.open([os.path.join(d, CKPT, "a") for d in st.dirs])
    assert values(ck) == [1.0] * 3 and ck.meta == {"v": 1}
    ck.close()
    # checkpoint + current + the spare set every crash-safe store keeps for its next write: 3 copies, no more
    assert disk_usage(st.dirs) < 3.1 * one
    st.close()
    assert restore(st.dirs, "a") == {"step": 1}
    with TensorStore.open(st.dirs) as back:
        assert values(back) == [1.0] * 3
        fill(back, 5)
    assert validate(st.dirs, "a") == {"step": 1}  # training after a restore leaves the checkpoint intact


def test_partial_checkpoints_do_not_count_and_prune_keeps_newest(tmp_path):
    st, _ = make(tmp_path)
    for v in range(1, 5):
        fill(st, v)
        take(st, f"c{v}", {"step": v})
    os.makedirs(os.path.join(st.dirs[0], CKPT, "c9.partial"))
    assert list_checkpoints(st.dirs) == ["c4", "c3", "c2", "c1"]
    assert sorted(prune(st.dirs, 2)) == ["c1", "c2", "c9.partial"]
    assert list_checkpoints(st.dirs) == ["c4", "c3"]
    with pytest.raises(StoreError, match="exists"):
        take(st, "c4", {})
    st.close()


def corrupt(path, offset=100_000):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))


def test_damaged_checkpoints_are_named_and_auto_falls_back(tmp_path):
    st, _ = make(tmp_path)
    for v in (1, 2, 3):
        fill(st, v)
        take(st, f"c{v}", {"step": v})
    st.close()
    d3 = os.path.join(st.dirs[1], CKPT, "c3")
    victim = sorted(f for f in os.listdir(d3) if f.endswith(".fy"))[0]
    corrupt(os.path.join(d3, victim))
    with pytest.raises(ChecksumError, match=victim):
        validate(st.dirs, "c3")
    d2 = os.path.join(st.dirs[0], CKPT, "c2")
    short = sorted(f for f in os.listdir(d2) if f.endswith(".fy"))[0]
    os.truncate(os.path.join(d2, short), 4096)
    with pytest.raises(StoreError, match="truncated"):
        validate(st.dirs, "c2")
    with pytest.warns(FuyouWarning, match="damaged"):
        assert resume_point(st.dirs, "auto") == ("c1", {"step": 1})
    with pytest.raises(ConfigError, match="damaged"):
        resume_point(st.dirs, os.path.join(st.dirs[0], CKPT, "c3"))
    with pytest.raises(ConfigError, match="not a checkpoint of this run"):
        resume_point(st.dirs, str(tmp_path))
