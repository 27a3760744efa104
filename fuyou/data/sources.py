"""Where records come from: ``--data`` specs → sources, and the column mapping applied to every record.

A spec is a JSONL file, a glob (``data/*.jsonl``, sorted), a Parquet file, a directory saved with
``datasets``' ``save_to_disk`` (a ``DatasetDict``'s ``train`` split), a directory of data files, or a
dataset id ``ORG/NAME[@REVISION]`` on the Hugging Face hub (through its cache: ``fuyou.models.hub``).
JSONL files are read by Fuyou's own streaming reader (records named ``FILE:LINE``); the others through
the ``datasets`` library (the ``data`` extra), as memory-mapped Arrow tables (records named
``NAME:ROW``, rows counted from 1).

Every record passes :func:`normalize` as it is read: ``--columns`` renames fields (``prompt=instruction``
reads the ``instruction`` field as the prompt), and ShareGPT conversations (``conversations`` or
``messages`` as ``[{"from": "human", "value": ...}, ...]``) become ``messages`` of ``role``/``content``.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from fuyou.data.formats import DataError, check_data_file, iter_records, read_record_at
from fuyou.errors import ConfigError

TARGETS = ("text", "prompt", "completion", "messages")
"""Field names a column mapping may fill."""

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
"""ShareGPT's ``from`` values → chat-template roles."""

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
"""A spec ending so names a file, never a hub dataset id."""
DATASETS_HINT = "pip install 'datasets>=3' (the fuyou 'data' extra)"

Reader = Callable[[int, int], dict[str, Any]]
"""``read(position, number)``: the normalized record at ``position`` (numbered ``number`` in messages)."""


def parse_columns(columns: str | Mapping[str, str] | None) -> dict[str, str]:
    """``{target: source column}`` from ``"prompt=instruction,completion=output"`` or a mapping; a source
    ``a+b`` joins the text of several columns (``prompt=instruction+input``).

    Raises ConfigError (naming ``--columns``) for a malformed pair, a target other than
    :data:`TARGETS`, or a target given twice.
    """
    if not columns:
        return {}
    if isinstance(columns, Mapping):
        pairs = [(str(k), str(v)) for k, v in columns.items()]
    else:
        pairs = []
        for item in str(columns).split(","):
            target, eq, source = (x.strip() for x in item.partition("="))
            if not eq or not target or not source:
                raise ConfigError(f"--columns expects TARGET=COLUMN pairs like prompt=instruction, got {item!r}")
            pairs.append((target, source))
    out: dict[str, str] = {}
    for target, source in pairs:
        if target not in TARGETS:
            raise ConfigError(f"--columns: {target!r} is not a field Fuyou reads; map to {', '.join(TARGETS)}")
        if target in out:
            raise ConfigError(f"--columns maps {target!r} twice")
        out[target] = source
    return out


def _sharegpt(turns: list[Any], name: str, number: int) -> list[Any]:
    """ShareGPT turns (``from``/``value``) as ``role``/``content`` messages; other items as they are.

    Raises DataError (``name:number``) for a role it does not know.
    """
    out: list[Any] = []
    for i, t in enumerate(turns):
        if isinstance(t, dict) and t.get("from") is not None and t.get("role") is None:
            role = SHAREGPT_ROLES.get(str(t["from"]).lower())
            if role is None:
                raise DataError(
                    f"{name}:{number}: conversation turn {i} is from {t['from']!r}; "
                    f"expected one of {', '.join(sorted(SHAREGPT_ROLES))}"
                )
            t = {"role": role, "content": t.get("value")}
        out.append(t)
    return out


def _column(record: dict[str, Any], target: str, source: str, name: str, number: int) -> Any:
    """The value ``--columns target=source`` gives: one column's, or for ``a+b`` the non-empty text of each
    joined by a newline (Alpaca's ``instruction+input``). Raises DataError (``name:number``) for a missing
    column, or a joined one that is not text."""
    parts = source.split("+")
    for col in parts:
        if col not in record:
            raise DataError(
                f"{name}:{number}: no column {col!r} (--columns {target}={source}); the record has {sorted(record)}"
            )
    if len(parts) == 1:
        return record[source]
    values = [record[c] for c in parts]
    bad = [c for c, v in zip(parts, values) if v is not None and not isinstance(v, str)]
    if bad:
        raise DataError(f"{name}:{number}: column {bad[0]!r} of --columns {target}={source} is not text")
    return "\n".join(v for v in values if v)


def normalize(record: dict[str, Any], columns: Mapping[str, str], name: str, number: int) -> dict[str, Any]:
    """``record`` with the ``columns`` mapping applied and ShareGPT conversations as ``messages``.

    Raises DataError (``name:number``) when a mapped column is missing, or as :func:`_sharegpt`.
    """
    if columns:
        mapped = {target: _column(record, target, source, name, number) for target, source in columns.items()}
        record = {k: v for k, v in record.items() if k not in TARGETS} | mapped
    if "messages" not in record and isinstance(record.get("conversations"), list):
        record = {**record, "messages": record["conversations"]}
    if isinstance(record.get("messages"), list):
        record = {**record, "messages": _sharegpt(record["messages"], name, number)}
    return record


class JsonlSource:
    """One JSONL file, streamed; its size and modification time at opening tell a changed file.

    Raises DataError at construction when the file is missing or unreadable.
    """

    def __init__(self, path: str | os.PathLike[str], columns: Mapping[str, str] | None = None) -> None:
        self.name = check_data_file(path)
        st = os.stat(self.name)
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
        self.columns = dict(columns or {})

    @property
    def fingerprint(self) -> str:
        """Identifies the file for a resume: its name and size (bytes)."""
        return f"{os.path.basename(self.name)}:{self.size}"

    def records(self) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """``(line number, byte offset, record)`` of every non-blank line (``formats.iter_records``)."""
        for line, offset, record in iter_records(self.name):
            yield line, offset, normalize(record, self.columns, self.name, line)

    @contextlib.contextmanager
    def open(self) -> Iterator[Reader]:
        """A reader of records by byte offset; DataError if the file changed since it was opened."""
        st = os.stat(self.name) if os.path.isfile(self.name) else None
        if st is None or (st.st_size, st.st_mtime_ns) != (self.size, self.mtime_ns):
            raise DataError(f"{self.name}: the data file changed or vanished since it was indexed")
        with open(self.name, "rb") as f:

            def read(offset: int, line: int) -> dict[str, Any]:
                return normalize(read_record_at(f, offset, self.name, line), self.columns, self.name, line)

            yield read


class TableSource:
    """A ``datasets.Dataset`` (memory-mapped Arrow): rows read by number, named ``name:ROW`` from 1."""

    def __init__(self, name: str, dataset: Any, columns: Mapping[str, str] | None = None) -> None:
        self.name, self.dataset = name, dataset
        self.columns = dict(columns or {})

    @property
    def fingerprint(self) -> str:
        """Identifies the table for a resume: its name, rows and ``datasets``' own fingerprint of its content."""
        return f"{os.path.basename(self.name.rstrip('/'))}:{len(self.dataset)}:{self.dataset._fingerprint}"

    def records(self) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """``(row number from 1, row index, record)`` of every row."""
        for i, row in enumerate(self.dataset):
            yield i + 1, i, normalize(dict(row), self.columns, self.name, i + 1)

    @contextlib.contextmanager
    def open(self) -> Iterator[Reader]:
        """A reader of rows by index (the table is immutable once loaded)."""

        def read(row: int, number: int) -> dict[str, Any]:
            return normalize(dict(self.dataset[row]), self.columns, self.name, number)

        yield read


Source = JsonlSource | TableSource


def _datasets(what: str) -> Any:
    """The ``datasets`` module; DataError naming the install command without it."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading {what} needs the datasets library; {DATASETS_HINT}") from None
    return datasets


def _train_split(loaded: Any, name: str) -> Any:
    """A Dataset, or a DatasetDict's ``train`` split; DataError naming the splits without one."""
    if hasattr(loaded, "keys") and not hasattr(loaded, "features"):
        if "train" not in loaded:
            raise DataError(f"{name}: the dataset has splits {sorted(loaded)} but no 'train'; save that split alone")
        return loaded["train"]
    return loaded


def _table_error(e: Exception, name: str) -> DataError:
    """One line for a table the ``datasets`` library could not read."""
    return DataError(f"{name}: cannot read it as a dataset ({type(e).__name__}: {' '.join(str(e).split())[:200]})")


def _directory(path: str, columns: Mapping[str, str], data_files: bool = False) -> TableSource:
    """A ``save_to_disk`` directory (``load_from_disk``), or with ``data_files`` (a hub dataset's snapshot) a
    directory of data files in the hub's layout (``load_dataset``). DataError for any other directory."""
    saved = any(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))
    if not saved and not data_files:
        raise DataError(
            f"data path is not a file: {path}; pass a JSONL or Parquet file, a glob such as "
            f"'{os.path.join(path, '*.jsonl')}', or a directory saved with datasets' save_to_disk"
        )
    ds = _datasets(f"the dataset directory {path}")
    try:
        loaded = ds.load_from_disk(path) if saved else ds.load_dataset(path, split="train")
    except (OSError, ValueError, TypeError, ds.exceptions.DatasetGenerationError) as e:
        raise _table_error(e, path) from e
    return TableSource(path, _train_split(loaded, path), columns)


def _parquet(path: str, columns: Mapping[str, str]) -> TableSource:
    """A Parquet file as a table (``Dataset.from_parquet``: converted once into ``datasets``' cache)."""
    ds = _datasets(f"the Parquet file {path}")
    try:
        return TableSource(path, ds.Dataset.from_parquet(path), columns)
    except (OSError, ValueError, TypeError, ds.exceptions.DatasetGenerationError) as e:
        raise _table_error(e, path) from e


def _expand(spec: str) -> list[str]:
    """The paths a spec names: a glob's matches (sorted), else the spec itself."""
    if not any(c in spec for c in "*?["):
        return [spec]
    found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p) or os.path.isdir(p))
    if not found:
        raise DataError(f"--data {spec!r} matches no file; check the pattern (quote it so the shell leaves it)")
    return found


def _hub_dataset(spec: str, columns: Mapping[str, str]) -> TableSource:
    """A dataset id from the hub (through its cache): its snapshot's data files, ``train`` split."""
    from fuyou.models.hub import resolve_model

    _datasets(f"the hub dataset {spec}")
    path = resolve_model(spec, ("*.parquet", "*.jsonl", "*.json", "*.arrow", "*.csv", "README.md"), "dataset")
    table = _directory(path, columns, data_files=True)
    return TableSource(spec, table.dataset, columns)


def open_sources(
    specs: str | os.PathLike[str] | Sequence[str], columns: Mapping[str, str] | None = None
) -> list[Source]:
    """The sources ``--data`` names, in the order given (each glob's matches sorted; repeats dropped).

    Raises DataError for a missing file, a glob without matches, an unreadable table, a dataset id
    that is neither local nor in the hub cache (ConfigError from ``fuyou.models.hub``), or Parquet /
    dataset input without the ``datasets`` library (naming the ``pip install``).
    """
    from fuyou.models.hub import parse_hub_id

    items = [os.fspath(specs)] if isinstance(specs, (str, os.PathLike)) else [os.fspath(s) for s in specs]
    if not items:
        raise DataError("no training data given; pass --data FILE (repeatable, globs allowed)")
    cols = dict(columns or {})
    out: list[Source] = []
    seen: set[str] = set()
    for spec in items:
        if not os.path.exists(spec) and not spec.endswith(DATA_SUFFIXES) and parse_hub_id(spec) is not None:
            out.append(_hub_dataset(spec, cols))
            continue
        paths = [p for p in _expand(spec) if os.path.realpath(p) not in seen]
        seen.update(os.path.realpath(p) for p in paths)
        for p in paths:
            if os.path.isdir(p):
                out.append(_directory(p, cols))
            elif p.endswith(".parquet"):
                out.append(_parquet(p, cols))
            else:
                out.append(JsonlSource(p, cols))
    return out
