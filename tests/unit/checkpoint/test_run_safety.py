"""Checkpoints are never lost by accident: ranking by step, set-aside instead of delete, safe replace,
and OS refusals (EMFILE…) reported as themselves rather than as damage."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from fuyou.checkpoint import list_checkpoints, prune, restore, take, validate
from fuyou.checkpoint.resume import resume_point, set_aside_newer
from fuyou.checkpoint.snapshot import CKPT, REPLACED, SET_ASIDE
from fuyou.errors import FuyouWarning
from fuyou.storage import TensorStore
from tests.unit.checkpoint.helpers import make_store

N = 50_000
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def make(tmp_path, ndirs=2):
    return make_store(tmp_path, N, ndirs, stripe_min=1 << 15)[0]


def fill(st, v):
    for e in st.extents:
        st.write(e.name, torch.full((N,), float(v)))
    return st.commit({"v": v})


def name(step):
    return f"step-{step:08d}"


def with_steps(tmp_path, steps=(1, 2, 3)):
    """A closed store with one checkpoint per step (store version = step)."""
    st = make(tmp_path)
    for s in steps:
        fill(st, s)
        take(st, name(s), {"step": s})
    st.close()
    return st.dirs


def corrupt(stripes, ckpt):
    d = os.path.join(stripes[1], CKPT, ckpt)
    victim = sorted(f for f in os.listdir(d) if f.endswith(".fy"))[0]
    with open(os.path.join(d, victim), "r+b") as f:
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 1]))


def set_aside_dirs(stripes):
    return [
        sorted(os.listdir(os.path.join(d, CKPT, SET_ASIDE))) if os.path.isdir(os.path.join(d, CKPT, SET_ASIDE)) else []
        for d in stripes
    ]


def all_files(stripes):
    """(relative path, inode) of every file under the stripes: what 'nothing deleted' compares."""
    out = set()
    for d in stripes:
        for root, _, files in os.walk(os.path.join(d, CKPT)):
            for f in files:
                out.add((f, os.stat(os.path.join(root, f)).st_ino))
    return out


# ---- item 3: rank by training step, and prune by that rank -------------------------------------------------------
def test_checkpoints_rank_by_training_step_not_store_version(tmp_path):
    st = make(tmp_path)
    fill(st, 1)
    take(st, name(1), {"step": 1})  # version 1
    fill(st, 2)
    fill(st, 2)
    take(st, name(2), {"step": 2})  # version 3
    fill(st, 3)
    take(st, name(3), {"step": 3})  # version 4
    st.close()
    restore(st.dirs, name(1))  # resuming step 1 restarts the store's versions at 1
    with TensorStore.open(st.dirs) as again:
        assert fill(again, 5) == 2
        take(again, name(5), {"step": 5})  # the newest step, at a lower version than steps 2 and 3
    assert list_checkpoints(st.dirs) == [name(5), name(3), name(2), name(1)]
    assert sorted(prune(st.dirs, 2)) == [name(1), name(2)]
    assert list_checkpoints(st.dirs) == [name(5), name(3)]
    assert validate(st.dirs, name(5)) == {"step": 5}


def test_step_from_the_name_when_trainer_state_has_none(tmp_path):
    st = make(tmp_path)
    fill(st, 1)
    take(st, "hf-checkpoint-9-1", {})
    fill(st, 2)
    take(st, "hf-checkpoint-4-2", {})
    st.close()
    assert list_checkpoints(st.dirs) == ["hf-checkpoint-9-1", "hf-checkpoint-4-2"]


# ---- item 2: resuming an older checkpoint sets the newer ones aside --------------------------------------------------
def test_resuming_an_older_checkpoint_sets_newer_ones_aside_and_frees_their_names(tmp_path):
    stripes = with_steps(tmp_path, (1, 2, 3))
    before = all_files(stripes)
    point = resume_point(stripes, os.path.join(stripes[0], CKPT, name(1)))
    assert point == (name(1), {"step": 1})
    with pytest.warns(FuyouWarning, match="set aside 2 checkpoint"):
        moved = set_aside_newer(stripes, point[0])
    assert [os.path.basename(m).split(".")[0] for m in moved] == [name(3), name(2)]
    assert all_files(stripes) == before  # moved, not deleted: same files, same inodes
    assert list_checkpoints(stripes) == [name(1)]
    for k, listing in enumerate(set_aside_dirs(stripes)):  # every stripe's part moved, under one name
        assert listing == sorted(os.path.basename(m) for m in moved), k
    kept = [os.path.join(d, CKPT, moved[0]) for d in stripes]
    with TensorStore.open(kept) as old3:  # the set-aside checkpoint is whole and readable
        buf = torch.empty(N)
        old3.read("e0", buf).result()
        assert buf[0].item() == 3.0
    restore(stripes, point[0])
    with TensorStore.open(stripes) as st:
        for s in (2, 3):  # the resumed run saves the same step names again
            fill(st, 10 + s)
            take(st, name(s), {"step": s})
        assert prune(stripes, 1) == [name(2), name(1)]
    assert len(set_aside_dirs(stripes)[0]) == 2  # never pruned
    assert validate(stripes, name(3)) == {"step": 3}


def test_auto_fallback_past_a_damaged_newest_sets_it_aside(tmp_path):
    stripes = with_steps(tmp_path, (1, 2, 3))
    corrupt(stripes, name(3))
    with pytest.warns(FuyouWarning, match="damaged"):
        point = resume_point(stripes, "auto")
    assert point[0] == name(2)
    with pytest.warns(FuyouWarning, match="set aside 1"):
        set_aside_newer(stripes, point[0])
    assert list_checkpoints(stripes) == [name(2), name(1)]
    restore(stripes, point[0])
    with TensorStore.open(stripes) as st:
        fill(st, 33)
        take(st, name(3), {"step": 3})  # used to fail: "checkpoint … exists already"
    assert validate(stripes, name(3)) == {"step": 3}


# ---- item 4: a fallback start deletes nothing ----------------------------------------------------------------------
def test_fresh_start_after_every_checkpoint_is_damaged_deletes_nothing(tmp_path):
    stripes = with_steps(tmp_path, (1, 2))
    for s in (1, 2):
        corrupt(stripes, name(s))
    os.makedirs(os.path.join(stripes[0], CKPT, "junk"))  # unlisted (no trainer.json): set aside too
    before = all_files(stripes)
    with pytest.warns(FuyouWarning, match="damaged"):
        assert resume_point(stripes, "auto") is None
    with pytest.warns(FuyouWarning, match="none of them is intact"):
        moved = set_aside_newer(stripes, None)
    assert len(moved) == 3 and list_checkpoints(stripes) == []
    assert all_files(stripes) == before
    assert sorted(os.listdir(os.path.join(stripes[0], CKPT))) == [SET_ASIDE]


# ---- item 6: replace publishes before it removes ---------------------------------------------------------------------
def states_now(stripes):
    """Trainer states of the complete checkpoints named c or c.replaced right now."""
    found = []
    for n in ("c", "c" + REPLACED):
        try:
            found.append(validate(stripes, n)["v"])
        except Exception:  # noqa: BLE001 - absent or incomplete at this instant
            pass
    return found


def test_replace_keeps_a_complete_checkpoint_at_every_instant(tmp_path, monkeypatch):
    st = make(tmp_path)
    fill(st, 1)
    take(st, "c", {"v": "old"})
    fill(st, 2)
    seen, busy = [], [False]

    def checked(fn):
        def wrapper(*a, **kw):
            if not busy[0]:
                busy[0] = True
                try:
                    seen.append(states_now(st.dirs))
                finally:
                    busy[0] = False
            return fn(*a, **kw)

        return wrapper

    monkeypatch.setattr(os, "rename", checked(os.rename))
    monkeypatch.setattr(shutil, "rmtree", checked(shutil.rmtree))
    take(st, "c", {"v": "new"}, replace=True)
    monkeypatch.undo()
    assert len(seen) > 5
    assert all(s for s in seen), seen  # before every rename and every removal: old or new complete
    assert validate(st.dirs, "c") == {"v": "new"}
    assert list_checkpoints(st.dirs) == ["c"]
    st.close()


def test_crash_on_the_publishing_rename_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    st = make(tmp_path)
    fill(st, 1)
    take(st, "c", {"v": "old", "step": 1})
    fill(st, 2)
    final0 = os.path.join(st.dirs[0], CKPT, "c")
    real = os.rename

    def crash(src, dst, *a, **kw):
        if os.fspath(dst) == final0 and os.fspath(src).endswith(".partial"):
            raise OSError(5, "injected crash before publishing")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(OSError, match="injected"):
        take(st, "c", {"v": "new", "step": 1}, replace=True)
    monkeypatch.undo()
    assert states_now(st.dirs) == ["old"]  # the old checkpoint is complete (as c.replaced) and resumable
    assert resume_point(st.dirs, "auto") == ("c" + REPLACED, {"v": "old", "step": 1})
    take(st, "c", {"v": "new", "step": 1}, replace=True)  # a retry publishes normally
    assert validate(st.dirs, "c") == {"v": "new", "step": 1}
    st.close()


# ---- item 5: an OS refusal while checking is an error that names it, not "damaged" ----------------------------------
CHILD = textwrap.dedent("""
    import json, os, resource, sys, warnings
    from fuyou.checkpoint.resume import resume_point
    stripes, resume = json.loads(sys.argv[1]), sys.argv[2]
    warnings.simplefilter("error")                       # a "damaged" warning would fail loudly
    fds = max(int(f) for f in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (fds + 3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        print(json.dumps({"ok": repr(resume_point(stripes, resume))}))
    except Exception as e:
        print(json.dumps({"type": type(e).__name__, "msg": str(e), "mro": [c.__name__ for c in type(e).__mro__]}))
""")


@pytest.mark.parametrize("which", ["auto", "path"])
def test_too_many_open_files_while_validating_is_named_not_damage(tmp_path, which):
    stripes = with_steps(tmp_path, (1, 2))
    resume = "auto" if which == "auto" else os.path.join(stripes[0], CKPT, name(2))
    r = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(stripes), resume],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "ok" not in out, out  # with 3 free descriptors, checking a 6-file checkpoint cannot succeed
    assert "FuyouError" in out["mro"] and "StoreError" not in out["mro"], out
    assert "damaged" not in out["msg"] and "open" in out["msg"].lower(), out  # EMFILE / open-file limit
    assert len(out["msg"].splitlines()) == 1
    assert list_checkpoints(stripes) == [name(2), name(1)]  # nothing moved or deleted
    assert validate(stripes, name(2)) == {"step": 2}


def test_permission_denied_while_validating_is_named_not_damage(tmp_path, monkeypatch):
    """EACCES cannot be produced for root by chmod: refuse opening the checkpoint's manifest instead."""
    import builtins

    from fuyou.checkpoint import CheckpointAccessError

    stripes = with_steps(tmp_path, (1, 2))
    real = builtins.open

    def refuse(path, *a, **kw):
        if os.fspath(path).endswith(os.path.join(name(2), "manifest.json")):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", refuse)
    with pytest.raises(CheckpointAccessError, match="EACCES"):
        resume_point(stripes, "auto")
    with pytest.raises(CheckpointAccessError, match="not damage"):
        validate(stripes, name(2))
