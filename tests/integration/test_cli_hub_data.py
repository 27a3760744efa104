"""``fuyou finetune`` / ``fuyou plan`` with a model by hub id (a hub cache built here, offline) and data as people
keep it: globs, several files, Parquet, ``save_to_disk`` directories, ``--columns``, ShareGPT; resume over them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fuyou.run.demo import _random_model
from tests.hub_cache import add_to_hub_cache
from tests.integration.test_cli_finetune import PC, ROOT, run, write_jsonl

COMMON = ["--seq-len", "32", "--micro-batch-size", "2", "--cpu-memory", "256MiB", "--no-progress"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _random_model(str(tmp_path_factory.mktemp("m") / "tiny"))


def fuyou(args, env):
    """The real console entry point in a fresh process, with ``env`` (HF_HUB_CACHE, HF_HUB_OFFLINE) as a user sets it."""
    return subprocess.run(
        [sys.executable, "-m", "fuyou.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, **env},
    )


def error_line(r):
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("planner: measuring")]
    assert len(lines) == 1, lines
    return lines[0]


def test_finetune_and_plan_a_model_by_hub_id_offline(tmp_path, model_dir):
    cache = str(tmp_path / "hub")
    snap = add_to_hub_cache(cache, "org/tiny-llama", model_dir)
    env = {"HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    for i in range(2):
        write_jsonl(tmp_path / f"part-{i}.jsonl", PC[20 * i : 20 * i + 20])
    out = tmp_path / "run"
    data = str(tmp_path / "part-*.jsonl")
    r = fuyou(["finetune", "org/tiny-llama", "--data", data, "--output", str(out), "--steps", "2", *COMMON], env)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "run.json").read_text())
    assert summary["model"] == snap and summary["model_id"] == "org/tiny-llama" and summary["steps"] == 2
    assert (out / "model" / "tokenizer.json").is_file() and (out / "model" / "model.safetensors.index.json").is_file()
    assert not os.path.islink(out / "model" / "tokenizer.json")  # copied out of the cache, not linked into it

    profile = os.path.join(ROOT, "bench", "profiles", "lohan_4090.json")
    r = fuyou(["plan", "org/tiny-llama@main", "--profile", profile], env)
    assert r.returncode == 0 and "org/tiny-llama@main" in r.stdout, r.stderr

    msg = error_line(fuyou(["finetune", "org/absent", "--data", data, "--output", str(tmp_path / "x"), *COMMON], env))
    assert "org/absent" in msg and "HF_HUB_OFFLINE" in msg and cache in msg
    assert not (tmp_path / "x").exists()
    msg = error_line(fuyou(["plan", "org/absent", "--profile", profile], env))
    assert "org/absent" in msg and "unset HF_HUB_OFFLINE" in msg


@pytest.fixture
def datasets_lib(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    return datasets


def test_parquet_and_saved_dataset_with_columns_resume_exactly(tmp_path, model_dir, datasets_lib):
    import pyarrow as pa
    import pyarrow.parquet as pq

    alpaca = [{"instruction": r["prompt"], "output": r["completion"]} for r in PC]
    pq.write_table(pa.Table.from_pylist(alpaca[:25]), tmp_path / "a.parquet")
    datasets_lib.Dataset.from_list(alpaca[25:]).save_to_disk(str(tmp_path / "saved"))
    data = ["--data", str(tmp_path / "a.parquet"), "--data", str(tmp_path / "saved")]
    cols = ["--columns", "prompt=instruction,completion=output"]
    out = tmp_path / "run"
    args = ["finetune", model_dir, *data, *cols, "--output", str(out), "--steps", "4", "--save-every", "2", *COMMON]
    args += ["--precision", "fp32"]  # bit-identical resume on CPU
    r = run(args)
    assert r.exit_code == 0, r.output
    whole = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    r = run([*args, "--resume", "auto"])  # continues from the step-2 checkpoint over the same sources
    assert r.exit_code == 0, r.output
    assert json.loads((out / "run.json").read_text())["resumed_from_step"] == 2
    assert [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()] == whole

    unmapped = [a for a in args if a not in cols]
    r = run([*unmapped, "--resume", "auto"])  # the columns unmapped: one line naming file and row
    assert r.exit_code == 1 and "a.parquet:1: record has keys ['instruction', 'output']" in r.output, r.output
    pq.write_table(pa.Table.from_pylist(alpaca[:24]), tmp_path / "a.parquet")  # other data now
    r = run([*args, "--resume", "auto"])
    errors = [x for x in r.output.splitlines() if x.startswith("error:")]  # (datasets' progress bars aside)
    assert r.exit_code == 1 and len(errors) == 1 and "cannot resume: the saved data position is for" in errors[0]


def test_sharegpt_files_from_a_yaml_list(tmp_path, model_dir):
    rows = [
        {"conversations": [{"from": "human", "value": f"Say {i}"}, {"from": "gpt", "value": f"{i} {i} {i}"}]}
        for i in range(30)
    ]
    a = write_jsonl(tmp_path / "a.jsonl", rows[:15])
    b = write_jsonl(tmp_path / "b.jsonl", rows[15:])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data: [{a}, {b}]\nsteps: 1\n")
    r = run(["finetune", model_dir, "--config", str(cfg), "--output", str(tmp_path / "run"), *COMMON])
    assert r.exit_code == 0, r.output
    mixed = write_jsonl(tmp_path / "mixed.jsonl", PC[:5])
    r = run(["finetune", model_dir, "--data", a, "--data", mixed, "--output", str(tmp_path / "r2"), *COMMON])
    assert r.exit_code == 1 and "mixed.jsonl:1: record is in the 'prompt_completion' format" in r.output, r.output
