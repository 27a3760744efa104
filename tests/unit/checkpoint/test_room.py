"""What checkpoints pin on the SSD (``fuyou.checkpoint.room``): measured on a real store whose live
version moved on, and the up-front refusal on a real small filesystem."""

import os
import pathlib

import pytest
import torch

from fuyou.checkpoint import prune, set_aside, take
from fuyou.checkpoint.room import check_room, pins, space_note
from fuyou.errors import StoreSpaceError
from fuyou.units import format_size
from tests.unit.checkpoint.helpers import make_store

N = 200_000  # 3 extents of 800 kB


def fill(st, v):
    for e in st.extents:
        st.write(e.name, torch.full((N,), float(v)))
    return st.commit({"v": v})


def test_pins_count_what_only_each_checkpoint_holds_and_the_note_names_them(tmp_path):
    st, _ = make_store(tmp_path, N, ndirs=1)
    fill(st, 1)
    take(st, "step-00000001", {"step": 1})
    fill(st, 2)
    take(st, "step-00000002", {"step": 2})
    version = sum(os.stat(os.path.join(st.dirs[0], f)).st_blocks * 512 for _, f in st.committed()[1])
    got = {p.name: p for p in pins(list(st.dirs))}
    assert got["step-00000002"].nbytes == 0  # the live store still uses its files
    assert got["step-00000001"].nbytes == version and got["step-00000001"].version == 1
    fill(st, 3)  # the live store moves on: now both pin a version of their own
    set_aside(list(st.dirs), ["step-00000001"])
    note = space_note(list(st.dirs))
    assert note.startswith(f"2 checkpoint(s) pin {format_size(2 * version)}"), note
    assert "step-00000002 (version 2," in note and "--keep-checkpoints 1" in note and "set-aside" in note, note
    assert prune(list(st.dirs), 1) == []  # a set-aside one is never pruned
    st.close()


def test_no_pins_says_so(tmp_path):
    st, _ = make_store(tmp_path, N, ndirs=1)
    fill(st, 1)
    assert space_note(list(st.dirs)) == "no checkpoint holds space beyond the live store"
    st.close()


@pytest.mark.root
def test_check_room_refuses_when_the_kept_checkpoints_will_not_fit(small_tmpfs):
    """8 MiB: the store (2 versions of 2.4 MB) fits, and one more pinned version; three more do not."""
    st, _ = make_store(pathlib.Path(small_tmpfs), N, ndirs=1)
    fill(st, 1)
    files, d = st.committed()[1], st.dirs[0]
    check_room([d], files, 1)
    with pytest.raises(StoreSpaceError) as e:
        check_room([d], files, 3)
    st.close()
    msg = str(e.value)
    assert msg.startswith(f"not enough room for checkpoints in {d}") and "--keep-checkpoints 2" in msg, msg
