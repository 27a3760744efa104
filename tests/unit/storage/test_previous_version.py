"""A commit confirmed by several ranks (``TensorStore.commit(agree=…)``) keeps the previous version until
every rank has written its own; a rank left a step ahead by a crash goes back to it (``roll_back``)."""

import os

import pytest
import torch

from fuyou.errors import StoreError
from fuyou.storage import TensorStore
from fuyou.storage.manifest import PREVIOUS
from tests.unit.storage.test_store import byte_extent, pattern, store

N = 70_000


class Died(Exception):
    """The collective that confirms a commit failed: a peer rank died."""


def fy_files(st: TensorStore) -> set[str]:
    return {f for d in st.dirs for f in os.listdir(d) if f.endswith(".fy")}


def read(st: TensorStore, name: str) -> torch.Tensor:
    out = torch.empty(N, dtype=torch.uint8)
    st.read(name, out).result()
    return out


def two_versions(tmp_path, ndirs: int = 2) -> TensorStore:
    """A store at step 2 whose commit of step 2 was never confirmed (the peer died); x changed, y did not."""
    st = store(tmp_path, [byte_extent("x", N), byte_extent("y", N)], ndirs=ndirs)
    st.write("x", pattern(N, 1))
    st.write("y", pattern(N, 9))
    st.commit({"step": 1}, agree=lambda v: None)
    st.write("x", pattern(N, 2))

    def peer_died(version: int) -> None:
        assert os.path.exists(os.path.join(st.dirs[0], PREVIOUS))
        raise Died

    with pytest.raises(Died):
        st.commit({"step": 2}, agree=peer_died)
    st.io.shutdown()  # the process exits here: no close
    return st


def test_a_confirmed_commit_keeps_nothing_and_recycles_the_old_files(tmp_path) -> None:
    st = store(tmp_path, [byte_extent("x", N)])
    st.write("x", pattern(N, 1))
    st.commit({"step": 1}, agree=lambda v: None)
    seen: list[tuple[int, bool, int]] = []
    st.write("x", pattern(N, 2))
    st.commit(
        {"step": 2},
        agree=lambda v: seen.append((v, os.path.exists(os.path.join(st.dirs[0], PREVIOUS)), len(fy_files(st)))),
    )
    assert seen == [(2, True, 2)]  # while the ranks confirm: the manifest of version 1 and its file are kept
    assert not os.path.exists(os.path.join(st.dirs[0], PREVIOUS)) and len(fy_files(st)) == 2  # one is a spare
    st.write("x", pattern(N, 3))  # the spare is reused: no third file
    st.commit({"step": 3}, agree=lambda v: None)
    assert len(fy_files(st)) == 2 and torch.equal(read(st, "x"), pattern(N, 3))
    st.close()
    with TensorStore.open(st.dirs) as again:
        assert again.previous is None and again.meta["step"] == 3


def test_a_rank_ahead_goes_back_to_the_kept_version(tmp_path) -> None:
    st = two_versions(tmp_path)
    with TensorStore.open(st.dirs) as again:
        assert again.meta["step"] == 2 and again.previous is not None and again.previous["meta"]["step"] == 1
        assert torch.equal(read(again, "x"), pattern(N, 2))
        again.roll_back()
        assert again.meta["step"] == 1 and again.version == 1 and again.previous is None
        assert torch.equal(read(again, "x"), pattern(N, 1)) and torch.equal(read(again, "y"), pattern(N, 9))
        assert not os.path.exists(os.path.join(again.dirs[0], PREVIOUS))
        with pytest.raises(StoreError, match="no previous version"):
            again.roll_back()
        again.write("x", pattern(N, 4))  # training goes on from step 1
        again.commit({"step": 2}, agree=lambda v: None)
    with TensorStore.open(st.dirs) as third:
        assert third.meta["step"] == 2 and torch.equal(read(third, "x"), pattern(N, 4))
        assert torch.equal(read(third, "y"), pattern(N, 9))


def test_a_rank_not_ahead_forgets_the_kept_version(tmp_path) -> None:
    st = two_versions(tmp_path)
    with TensorStore.open(st.dirs) as again:
        n = len(fy_files(again))
        again.forget_previous()
        assert again.previous is None and len(fy_files(again)) == n - 2  # x's version-1 pieces on 2 stripes
        assert torch.equal(read(again, "x"), pattern(N, 2)) and torch.equal(read(again, "y"), pattern(N, 9))
        with pytest.raises(StoreError, match="no previous version"):
            again.roll_back()
    with TensorStore.open(st.dirs) as third:
        assert third.previous is None and third.meta["step"] == 2


def test_a_commit_without_confirmation_drops_a_kept_version(tmp_path) -> None:
    st = two_versions(tmp_path, ndirs=1)
    with TensorStore.open(st.dirs) as again:
        again.write("y", pattern(N, 5))
        again.commit({"step": 3})
        assert again.previous is None and len(fy_files(again)) == 2 + 1  # x, y, and y's spare
    with TensorStore.open(st.dirs) as third:
        assert third.previous is None and torch.equal(read(third, "x"), pattern(N, 2))


def test_a_kept_version_with_a_missing_file_is_not_offered(tmp_path) -> None:
    st = two_versions(tmp_path, ndirs=1)
    with TensorStore.open(st.dirs) as again:
        old = [f for _, f, _ in again.previous["files"]["x"]]
    os.unlink(os.path.join(st.dirs[0], old[0]))
    with TensorStore.open(st.dirs) as third:
        assert third.previous is None and third.meta["step"] == 2
