"""Data as people keep it: several files and globs, Parquet, ``save_to_disk`` directories, hub dataset ids,
a column mapping and ShareGPT conversations — one index, exact resume, one-line errors naming file and row."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fuyou.data.build import build_datasets
from fuyou.data.formats import DataError
from fuyou.data.index import build_index
from fuyou.data.loader import BatchLoader
from fuyou.data.sources import normalize, open_sources, parse_columns
from fuyou.data.tokenize import Encoder
from fuyou.errors import ConfigError
from tests.hub_cache import add_to_hub_cache
from tests.unit.data.helpers import WORDS, write_jsonl

datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

PC = [{"prompt": f"what is {WORDS[i]}", "completion": f"it is {WORDS[i + 1]} {WORDS[i + 2]}"} for i in range(30)]
ALPACA = [{"instruction": r["prompt"], "output": r["completion"], "input": ""} for r in PC]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``datasets``' Arrow cache (what HF_DATASETS_CACHE sets) in the test's directory."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


def parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def records(index: Any) -> list[dict[str, Any]]:
    """Every indexed record, read back through its source."""
    out = []
    for k, pos, line in zip(index.source_ids, index.offsets, index.lines):
        with index.sources[int(k)].open() as read:
            out.append(read(int(pos), int(line)))
    return out


def test_files_and_globs_make_one_index_in_order(tmp_path: Path, tiny_tok: Any) -> None:
    for i in range(3):
        write_jsonl(tmp_path / f"part-{i}.jsonl", PC[10 * i : 10 * i + 10])
    first = write_jsonl(tmp_path / "first.jsonl", PC[:2])
    index = build_index([str(first), str(tmp_path / "part-*.jsonl"), str(first)], Encoder(tiny_tok))
    assert [s.name for s in index.sources] == [str(first)] + [str(tmp_path / f"part-{i}.jsonl") for i in range(3)]
    assert records(index) == PC[:2] + PC  # the repeated file is read once
    assert index.path == f"{first} (+3 more)" and index.fingerprint.count("+") == 3


def test_parquet_save_to_disk_and_jsonl_together(tmp_path: Path, tiny_tok: Any) -> None:
    pqf = parquet(tmp_path / "a.parquet", PC[:10])
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(PC[10:20]), "test": datasets.Dataset.from_list(PC[:1])}
    ).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(PC[20:25]).save_to_disk(str(tmp_path / "plain"))
    js = write_jsonl(tmp_path / "c.jsonl", PC[25:])
    specs = [str(pqf), str(tmp_path / "saved"), str(tmp_path / "plain"), str(js)]
    index = build_index(specs, Encoder(tiny_tok))
    assert records(index) == PC and index.fmt == "prompt_completion"
    assert list(index.lines[:3]) == [1, 2, 3]  # rows counted from 1


def test_hub_dataset_id_from_the_cache(tmp_path: Path, tiny_tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    parquet(repo / "data" / "train-00000-of-00001.parquet", ALPACA)
    parquet(repo / "data" / "test-00000-of-00001.parquet", ALPACA[:2])
    cache = str(tmp_path / "hub")
    add_to_hub_cache(cache, "org/alpaca-tiny", str(repo), repo_type="dataset")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    index = build_index(
        ["org/alpaca-tiny"], Encoder(tiny_tok), columns=parse_columns("prompt=instruction,completion=output")
    )
    assert [r["prompt"] for r in records(index)] == [r["prompt"] for r in PC]  # the train split only
    assert index.sources[0].name == "org/alpaca-tiny"
    with pytest.raises(ConfigError, match=r"dataset org/absent is not in the hub cache .* unset HF_HUB_OFFLINE"):
        open_sources(["org/absent"])


def test_column_mapping_and_sharegpt(tiny_tok: Any) -> None:
    cols = parse_columns("prompt=instruction, completion=output")
    assert normalize(ALPACA[0], cols, "f", 1) == ALPACA[0] | PC[0]  # read as prompt/completion; other fields kept
    # mapped fields replace any of Fuyou's names the record has, so the format is the mapping's
    assert normalize({"text": "a", "body": "b"}, {"prompt": "body", "completion": "body"}, "f", 1) == {
        "body": "b",
        "prompt": "b",
        "completion": "b",
    }
    share = {
        "conversations": [
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "ok"},
        ]
    }
    assert normalize(share, {}, "f", 1)["messages"] == [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"},
    ]
    assert parse_columns({"messages": "dialog"}) == {"messages": "dialog"}
    both = parse_columns("prompt=instruction+input,completion=output")
    assert normalize(ALPACA[0] | {"input": "a b"}, both, "f", 1)["prompt"] == f"{PC[0]['prompt']}\na b"
    assert normalize(ALPACA[0], both, "f", 1)["prompt"] == PC[0]["prompt"]  # an empty input adds nothing
    with pytest.raises(DataError, match=r"f:7: column 'input' of --columns prompt=instruction\+input is not text"):
        normalize(ALPACA[0] | {"input": 3}, both, "f", 7)
    for bad, words in (("prompt", "TARGET=COLUMN"), ("label=output", "not a field"), ("text=a,text=b", "twice")):
        with pytest.raises(ConfigError, match=words):
            parse_columns(bad)


def test_sharegpt_trains_assistant_turns_only(tmp_path: Path, tiny_tok: Any) -> None:
    rows = [
        {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": f"sure {w}"}]}
        for w in WORDS[:20]
    ]
    share = write_jsonl(tmp_path / "share.jsonl", rows)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": normalize(r, {}, "", 0)["messages"]} for r in rows])
    a = BatchLoader(build_datasets(share, tiny_tok, 8)[0], 2)
    b = BatchLoader(build_datasets(chat, tiny_tok, 8)[0], 2)
    for x, y in zip(a.batches(steps=3), b.batches(steps=3)):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])


def one_line(exc: type[Exception], pattern: str, specs: Any, tok: Any, **kw: Any) -> None:
    with pytest.raises(exc, match=pattern) as info:
        build_datasets(specs, tok, 2, **kw)
    assert "\n" not in str(info.value)


def test_bad_and_mixed_records_name_file_and_row(tmp_path: Path, tiny_tok: Any) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", PC[:5])
    bad = write_jsonl(tmp_path / "bad.jsonl", [PC[0], {"text": "a b"}])
    one_line(
        DataError,
        r"bad\.jsonl:2: record is in the 'text' format but earlier records are 'prompt_completion'",
        [str(good), str(bad)],
        tiny_tok,
    )
    table = parquet(tmp_path / "t.parquet", [*PC[:3], {"prompt": "what", "completion": None}])
    one_line(DataError, r"t\.parquet:4: 'completion' must be a string, got NoneType", [str(good), str(table)], tiny_tok)
    one_line(
        DataError,
        r"good\.jsonl:1: no column 'instruction' \(--columns prompt=instruction\)",
        str(good),
        tiny_tok,
        columns="prompt=instruction",
    )
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"conversations": [{"from": "narrator", "value": "x"}]}])
    one_line(DataError, r"odd\.jsonl:1: conversation turn 0 is from 'narrator'", str(odd), tiny_tok)
    one_line(DataError, r"--data '.*nothing-\*\.jsonl' matches no file", [str(tmp_path / "nothing-*.jsonl")], tiny_tok)
    one_line(DataError, r"data path is not a file: .*; pass a JSONL or Parquet file, a glob", [str(tmp_path)], tiny_tok)


def test_without_datasets_parquet_names_the_install(
    tmp_path: Path, tiny_tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = parquet(tmp_path / "t.parquet", PC)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: `import datasets` fails
    one_line(DataError, r"t\.parquet needs the datasets library; pip install 'datasets>=3'", [str(table)], tiny_tok)
    build_datasets(write_jsonl(tmp_path / "d.jsonl", PC), tiny_tok, 4)  # JSONL needs nothing more


def test_resume_over_several_sources_and_a_changed_one_refuses(tmp_path: Path, tiny_tok: Any) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", PC[:15])
    t = parquet(tmp_path / "b.parquet", PC[15:])
    specs = [str(a), str(t)]

    def loader() -> BatchLoader:
        return BatchLoader(build_datasets(specs, tiny_tok, 4, seed=3, eval_fraction=0.1)[0], 3)

    whole = list(loader().batches(steps=8))
    first = loader()
    list(first.batches(steps=4))
    again = loader()
    again.load_state_dict(first.state_dict())
    rest = list(again.batches(steps=8))
    assert len(rest) == 4 and all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(whole[4:], rest))
    write_jsonl(tmp_path / "a.jsonl", PC[:14])  # one record fewer: other data
    with pytest.raises(DataError, match="cannot resume: the saved data position is for"):
        loader().load_state_dict(first.state_dict())
