"""`fuyou finetune` never loses a run by accident: a fresh start over an earlier run refuses (unless
--overwrite), resuming an older checkpoint sets the newer ones aside, and a fallback start deletes nothing."""

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from fuyou.checkpoint import list_checkpoints
from fuyou.checkpoint.snapshot import CKPT, SET_ASIDE
from fuyou.cli.main import main
from fuyou.run.demo import _random_model

TEXT = [{"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # some python {i}"} for i in range(40)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("nowipe")
    model = _random_model(str(root / "tiny"))
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TEXT))
    return model, str(data)


def finetune(setup, out, *extra, steps=3):
    model, data = setup
    args = [
        "finetune",
        model,
        "--data",
        data,
        "--output",
        str(out),
        "--steps",
        str(steps),
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--cpu-memory",
        "256MiB",
        "--precision",
        "fp32",
        "--plan",
        "rules",
        "--no-progress",
        *extra,
    ]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def tree(*roots):
    """Every file under ``roots``: path → (inode, size, mtime): what 'nothing deleted or changed' compares."""
    out = {}
    for r in roots:
        for base, _, files in os.walk(r):
            for f in files:
                p = os.path.join(base, f)
                st = os.stat(p)
                out[p] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def error_line(r):
    assert r.exit_code == 1, r.output
    lines = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, r.output
    return lines[0]


def set_aside(stripe):
    d = os.path.join(stripe, CKPT, SET_ASIDE)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def corrupt_one_file(stripe, ckpt):
    d = os.path.join(stripe, CKPT, ckpt)
    victim = max((f for f in os.listdir(d) if f.endswith(".fy")), key=lambda f: os.path.getsize(os.path.join(d, f)))
    with open(os.path.join(d, victim), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))


def test_fresh_start_over_an_earlier_run_refuses_and_overwrite_allows_it(setup, tmp_path):
    out = tmp_path / "run"
    assert finetune(setup, out, "--save-every", "1").exit_code == 0
    store = out / "store"
    assert list_checkpoints([str(store)]) == ["step-00000002", "step-00000001"]
    before = tree(out)
    msg = error_line(finetune(setup, out, "--save-every", "1"))
    for what in (
        "run.json",
        "model/",
        f"a store in {store}",
        "checkpoint",
        "step-00000001",
        "pass --resume auto to continue, or --overwrite to start over",
    ):
        assert what in msg, (what, msg)
    assert tree(out) == before  # nothing deleted, nothing touched

    cfg = tmp_path / "c.yaml"
    cfg.write_text("overwrite: true\n")  # the config key does what the flag does
    first = json.loads((out / "run.json").read_text())
    r = finetune(setup, out, "--config", str(cfg), steps=2)
    assert r.exit_code == 0, r.output
    assert json.loads((out / "run.json").read_text())["steps"] == 2 != first["steps"]
    assert list_checkpoints([str(store)]) == [] and not os.path.exists(store / CKPT)  # --save-every 0 now


def test_store_left_in_an_ssd_directory_refuses_a_fresh_start(setup, tmp_path):
    ssd = tmp_path / "nvme"
    ssd.mkdir()
    assert finetune(setup, tmp_path / "a", "--ssd", str(ssd), steps=1).exit_code == 0
    before = tree(ssd)
    msg = error_line(finetune(setup, tmp_path / "b", "--ssd", str(ssd), steps=1))
    assert f"a store in {ssd}" in msg and "--overwrite" in msg and "run.json" not in msg, msg
    assert tree(ssd) == before and not (tmp_path / "b" / "run.json").exists()
    r = finetune(setup, tmp_path / "b", "--ssd", str(ssd), "--overwrite", steps=1)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "b" / "run.json").exists()


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(setup, tmp_path):
    out = tmp_path / "run"
    common = ["--save-every", "1", "--keep-checkpoints", "10"]
    assert finetune(setup, out, *common, steps=5).exit_code == 0
    stripe = str(out / "store")
    straight = json.loads((out / "run.json").read_text())
    assert list_checkpoints([stripe])[0] == "step-00000004"
    r = finetune(setup, out, *common, "--resume", os.path.join(stripe, CKPT, "step-00000002"), steps=5)
    assert r.exit_code == 0, r.output  # used to fail: "checkpoint …/step-00000003 exists already"
    resumed = json.loads((out / "run.json").read_text())
    assert resumed["resumed_from_step"] == 2 and resumed["last_loss"] == straight["last_loss"]
    assert list_checkpoints([stripe]) == [f"step-{s:08d}" for s in (4, 3, 2, 1)]
    kept = set_aside(stripe)
    assert [k.split(".")[0] for k in kept] == ["step-00000003", "step-00000004"], kept
    assert os.path.isfile(os.path.join(stripe, CKPT, SET_ASIDE, kept[0], "trainer.json"))


def test_auto_falls_back_past_a_damaged_checkpoint_and_deletes_nothing(setup, tmp_path):
    out = tmp_path / "run"
    common = ["--save-every", "1", "--keep-checkpoints", "2", "--resume", "auto"]
    assert finetune(setup, out, *common, steps=5).exit_code == 0
    stripe = str(out / "store")
    assert list_checkpoints([stripe]) == ["step-00000004", "step-00000003"]
    corrupt_one_file(stripe, "step-00000004")
    r = finetune(setup, out, *common, steps=5)
    assert r.exit_code == 0, r.output  # used to fail: step-00000004 "exists already"
    assert json.loads((out / "run.json").read_text())["resumed_from_step"] == 3
    assert list_checkpoints([stripe]) == ["step-00000004", "step-00000003"]
    assert [k.split(".")[0] for k in set_aside(stripe)] == ["step-00000004"]  # the damaged one, kept


def test_auto_with_every_checkpoint_damaged_starts_fresh_and_deletes_nothing(setup, tmp_path):
    out = tmp_path / "run"
    common = ["--save-every", "1", "--keep-checkpoints", "2", "--resume", "auto"]
    assert finetune(setup, out, *common).exit_code == 0
    stripe = str(out / "store")

    def damage_all():
        for name in list_checkpoints([stripe]):
            corrupt_one_file(stripe, name)

    damage_all()
    os.unlink(out / "run.json")  # as if that run had been interrupted before finishing (it writes both last)
    shutil.rmtree(out / "model")
    kept = {v[0] for v in tree(os.path.join(stripe, CKPT)).values()}
    r = finetune(setup, out, *common)
    assert r.exit_code == 0, r.output
    assert json.loads((out / "run.json").read_text())["resumed_from_step"] == 0
    assert [k.split(".")[0] for k in set_aside(stripe)] == ["step-00000001", "step-00000002"]  # not pruned
    assert kept <= {v[0] for v in tree(os.path.join(stripe, CKPT)).values()}, "a damaged checkpoint's file was deleted"

    damage_all()  # the new run's checkpoints too, and this time the run had finished
    before = tree(out)
    msg = error_line(finetune(setup, out, *common))  # a fresh start would replace the finished model
    assert "no intact checkpoint" in msg and "run.json" in msg and "--overwrite" in msg, msg
    assert tree(out) == before
