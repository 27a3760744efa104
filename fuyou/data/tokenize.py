"""Records → token ids and loss labels (``-100`` where no loss is taken).

Labels are aligned with the ids (``labels[t] == ids[t]`` where trained); the model shifts them.

* ``text``: ``[BOS] + tokens(text) + [EOS]``; every token trained except the BOS.
* ``prompt_completion``: ``[BOS] + tokens(prompt) + tokens(completion) + [EOS]``, prompt and
  completion tokenized separately so the boundary is exact; completion and EOS trained.
* ``messages``: the chat template's text, tokenized once. Assistant turn ``k`` spans from the end
  of ``template(messages[:k], add_generation_prompt=True)`` to the end of
  ``template(messages[:k+1])``; when those renderings tokenize to prefixes of the whole
  conversation the token-length differences give the span exactly, otherwise token character
  offsets do (a token is trained when it starts inside the span). The span is cut after its last
  EOS token, so the template's newline after the end-of-turn token is not trained. Nothing else
  is trained, and no EOS is appended (the template ends turns itself).

BOS is prepended only if the tokenizer adds one by default (e.g. Llama, not SmolLM2/GPT-2).
"""

from __future__ import annotations

from typing import Any

from fuyou.data.formats import MESSAGES, PROMPT_COMPLETION, TEXT, DataError

IGNORE_INDEX = -100


def _ids(out: Any) -> list[int]:
    """Token ids from a tokenizer/chat-template result (list, dict or BatchEncoding)."""
    if isinstance(out, (list, tuple)):
        return list(out)
    return list(out["input_ids"])


class Encoder:
    """Turns validated records into ``(input_ids, labels)`` lists with a Hugging Face tokenizer.

    Raises DataError at construction when the tokenizer has no EOS token.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise DataError("the tokenizer has no EOS token; set tokenizer.eos_token before training")
        self.eos_id: int = int(eos)
        bos = getattr(tokenizer, "bos_token_id", None)
        first = _ids(tokenizer("a"))[:1]
        self.bos_ids: list[int] = [int(bos)] if bos is not None and first == [bos] else []

    def tokens(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return _ids(self.tokenizer(text, add_special_tokens=False, verbose=False))

    def check_chat_template(self, path: str) -> None:
        """Raise DataError (naming ``path``) if the tokenizer has no chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise DataError(
                f"{path}: the 'messages' format needs a tokenizer with a chat template, and this "
                "tokenizer has none; set tokenizer.chat_template or use 'text' or "
                "'prompt'/'completion' records"
            )

    def encode(
        self, record: dict[str, Any], fmt: str, path: str = "<data>", line_no: int = 0
    ) -> tuple[list[int], list[int]]:
        """Return ``(input_ids, labels)`` of one validated record in format ``fmt``.

        Raises DataError (``path:line_no``) when a chat template cannot be rendered or its
        assistant turns cannot be located.
        """
        if fmt == TEXT:
            body = self.tokens(record[TEXT]) + [self.eos_id]
            return self.bos_ids + body, [IGNORE_INDEX] * len(self.bos_ids) + body
        if fmt == PROMPT_COMPLETION:
            prompt = self.bos_ids + self.tokens(record["prompt"])
            completion = self.tokens(record["completion"]) + [self.eos_id]
            return prompt + completion, [IGNORE_INDEX] * len(prompt) + completion
        if fmt == MESSAGES:
            return self._encode_messages(record[MESSAGES], path, line_no)
        raise ValueError(f"unknown format {fmt!r}")

    def _render(self, messages: list[dict[str, Any]], gen: bool, path: str, line_no: int) -> str:
        """The chat template's text for ``messages``; DataError if the template fails."""
        try:
            out = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        except Exception as e:  # jinja errors, template-raised exceptions
            raise DataError(
                f"{path}:{line_no}: the chat template failed on this record: {' '.join(str(e).split())}"
            ) from None
        return str(out)

    def _assistant_spans(
        self, messages: list[dict[str, Any]], full: str, path: str, line_no: int
    ) -> list[tuple[int, int]]:
        """Character spans ``[start, end)`` of the assistant turns in the rendered ``full`` text."""
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self._render(messages[:k], True, path, line_no)
            end = self._render(messages[: k + 1], False, path, line_no)
            if not (end.startswith(start) and full.startswith(end)):
                raise DataError(
                    f"{path}:{line_no}: cannot locate assistant turn messages[{k}] in the chat "
                    "template output (rendering a prefix of the conversation does not give a "
                    "prefix of the whole); this template is not supported for loss masking"
                )
            spans.append((len(start), len(end)))
        return spans

    def _encode_messages(self, messages: list[dict[str, Any]], path: str, line_no: int) -> tuple[list[int], list[int]]:
        """Ids and labels of a conversation, loss on assistant turns (see the module docstring)."""
        full = self._render(messages, False, path, line_no)
        fast = bool(getattr(self.tokenizer, "is_fast", False))
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=fast, verbose=False)
        ids = list(enc["input_ids"])
        offsets = list(enc["offset_mapping"]) if fast else None
        mask = [False] * len(ids)
        cache: dict[int, int | None] = {}
        for c0, c1 in self._assistant_spans(messages, full, path, line_no):
            t0 = self._token_boundary(full, c0, ids, offsets, cache, path, line_no)
            t1 = self._token_boundary(full, c1, ids, offsets, cache, path, line_no)
            if self.eos_id in ids[t0:t1]:
                t1 = t0 + max(i for i, t in enumerate(ids[t0:t1]) if t == self.eos_id) + 1
            for t in range(t0, t1):
                mask[t] = True
        labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids, mask)]
        return ids, labels

    def _token_boundary(
        self,
        full: str,
        char: int,
        ids: list[int],
        offsets: list[tuple[int, int]] | None,
        cache: dict[int, int | None],
        path: str,
        line_no: int,
    ) -> int:
        """Index of the first token of ``full`` at or after character ``char``.

        Exact when ``full[:char]`` tokenizes to a prefix of ``ids`` (the length of that prefix);
        otherwise the first token whose start offset is ``>= char``. Raises DataError when that
        needs offsets and the tokenizer is not a fast one (no offsets).
        """
        if char not in cache:
            prefix = self.tokens(full[:char]) if char else []
            cache[char] = len(prefix) if ids[: len(prefix)] == prefix else None
        exact = cache[char]
        if exact is not None:
            return exact
        if offsets is None:
            raise DataError(
                f"{path}:{line_no}: cannot align the chat template's assistant turns with tokens "
                "(no token offsets from this slow tokenizer); use a fast tokenizer"
            )
        return next((i for i, (s, _) in enumerate(offsets) if s >= char), len(ids))
