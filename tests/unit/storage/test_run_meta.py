"""``StoreMeta``, the one record of a training store's run: its JSON round trip, defaults left out (so
older stores read back as the defaults), and the clear errors for a store that is not a training one."""

from __future__ import annotations

import pytest
import torch

from fuyou.errors import ConfigError, ManifestError
from fuyou.storage.run_meta import StoreMeta, dtype_name, precision_name


def test_round_trip_and_defaults_left_out():
    full = StoreMeta(
        step=7, lr=1e-4, compute_dtype=torch.bfloat16, optimizer_state="split", state_chunk=1 << 20,
        source_dtype=torch.float16, origin=True, rank=1, world=2, lora_base=True, expert_groups=2,
        vocab_groups=3, freeze=("model.layers.0.*",),
    )  # fmt: skip
    js = full.to_json()
    assert js["frozen"] is True and js["freeze"] == ["model.layers.0.*"] and js["compute_dtype"] == "bfloat16"
    assert StoreMeta.from_json(js, "d") == full
    plain = StoreMeta(step=0, lr=1e-5, compute_dtype=torch.float32, optimizer_state="fp32", state_chunk=64,
                      source_dtype=torch.float32)  # fmt: skip
    assert set(plain.to_json()) == {"step", "lr", "compute_dtype", "optimizer_state", "state_chunk", "source_dtype"}
    assert StoreMeta.from_json(plain.to_json(), "d") == plain


def test_an_older_store_without_source_dtype_reads_its_compute_dtype():
    meta = StoreMeta.from_json(
        {"step": 3, "compute_dtype": "bfloat16", "state_dtype": "float32", "state_chunk": 8}, "d"
    )
    assert meta.source_dtype == torch.bfloat16 and meta.world == 1 and meta.freeze == ()
    assert meta.optimizer_state == "fp32"


def test_an_older_store_with_bf16_moments_reads_as_the_fp32_bf16_format():
    meta = StoreMeta.from_json({"compute_dtype": "bfloat16", "state_dtype": "bfloat16", "state_chunk": 8}, "d")
    assert meta.optimizer_state == "fp32-bf16"


def test_not_a_training_store_and_unknown_dtypes_are_one_line_errors():
    with pytest.raises(ManifestError, match="is not a Fuyou training store"):
        StoreMeta.from_json({"step": 1}, "/some/dir")
    with pytest.raises(ConfigError, match="unsupported dtype"):
        StoreMeta.from_json({"compute_dtype": "float8", "state_chunk": 8}, "d")


def test_dtype_names():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert precision_name(torch.float32) == "fp32" and precision_name(torch.float16) == "fp16"
    with pytest.raises(ConfigError):
        precision_name(torch.int8)
