"""Hugging Face model directories: config, streamed safetensors reading, streamed export.

Reading opens each shard lazily and returns one tensor at a time, so importing a model never holds
more than one block's tensors. Export writes shards of at most ``max_shard_bytes`` plus the index,
the config and the tokenizer files, so ``from_pretrained`` loads the result.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch

from fuyou.errors import FuyouError, os_limit_error

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


class ModelFileError(FuyouError):
    """A model directory or one of its files is missing, unreadable or inconsistent."""


def load_config(model_dir: str) -> Any:
    """Read ``model_dir/config.json`` with transformers (local files only).

    Raises ModelFileError if the directory or config is missing or unreadable.
    """
    from transformers import AutoConfig

    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelFileError(
            f"{model_dir} is not a model directory (no config.json); pass a Hugging Face model directory"
        )
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise (os_limit_error(e, f"reading {path}", probe=path) or ModelFileError(f"cannot read {path}: {e}")) from e


class CheckpointReader:
    """Tensors of a model directory's safetensors files (sharded or not), read one at a time."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._open: dict[str, Any] = {}
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                self.where: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            self.where = {k: "model.safetensors" for k in self._keys("model.safetensors")}
        else:
            raise ModelFileError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")

    def _handle(self, fname: str) -> Any:
        """The open safetensors file ``fname``.

        Raises SystemLimitError if an OS limit (open files, memory) stops it, else ModelFileError.
        """
        from safetensors import safe_open

        if fname not in self._open:
            path = os.path.join(self.model_dir, fname)
            try:
                self._open[fname] = safe_open(path, framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise (
                    os_limit_error(e, f"reading {path}", probe=path)
                    or ModelFileError(f"cannot read {path}: {e}; the file is missing or corrupt")
                ) from e
        return self._open[fname]

    def _keys(self, fname: str) -> list[str]:
        return list(self._handle(fname).keys())

    def close(self) -> None:
        """Drop the open shards (and their memory maps, whose touched pages count as resident)."""
        self._open.clear()

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key``; raises ModelFileError if absent or unreadable, SystemLimitError if an
        OS limit (open files, memory) stops the read."""
        if key not in self.where:
            raise ModelFileError(f"{self.model_dir} has no tensor {key!r}; is this the right model?")
        try:
            return self._handle(self.where[key]).get_tensor(key)
        except ModelFileError:
            raise
        except Exception as e:
            where = os.path.join(self.model_dir, self.where[key])
            raise (
                os_limit_error(e, f"reading {key!r} from {where}")
                or ModelFileError(f"cannot read {key!r} from {self.where[key]} in {self.model_dir}: {e}")
            ) from e


def save_streamed(
    out_dir: str,
    tensors: Iterator[tuple[str, torch.Tensor]],
    config: Any,
    dtype: torch.dtype,
    max_shard_bytes: int = 2 << 30,
    copy_from: str | None = None,
) -> None:
    """Write ``(key, tensor)`` pairs as sharded safetensors + index, the config, and tokenizer files.

    ``dtype`` is recorded in the saved config. Holds at most one shard in memory. Writes into ``out_dir + '.partial'`` and renames at the end,
    so an interrupted export never looks finished.
    """
    from safetensors.torch import save_file

    tmp = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    names: list[str] = []

    def flush() -> None:
        name = f"model-{len(names) + 1:05d}.safetensors"
        save_file(shards[-1], os.path.join(tmp, name), metadata={"format": "pt"})
        names.append(name)

    weight_map: dict[str, int] = {}
    for key, t in tensors:
        if size and size + t.numel() * t.element_size() > max_shard_bytes:
            flush()
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        weight_map[key] = len(names)
        size += t.numel() * t.element_size()
    flush()
    final = [f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i in range(len(names))]
    for a, b in zip(names, final):
        os.rename(os.path.join(tmp, a), os.path.join(tmp, b))
    total = sum(os.path.getsize(os.path.join(tmp, b)) for b in final)
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump(
            {"metadata": {"total_size": total}, "weight_map": {k: final[i] for k, i in weight_map.items()}}, f, indent=1
        )
    config = copy.deepcopy(config)
    config.dtype = dtype  # from_pretrained then loads the weights in the dtype they were saved in
    config.save_pretrained(tmp)
    if copy_from:
        for fname in TOKENIZER_FILES:
            src = os.path.join(copy_from, fname)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(tmp, fname))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
