"""The language model inside a multimodal checkpoint: Fuyou trains it and carries the rest unchanged.

Llama 4, Gemma 3 (4B and up), Qwen3.5 and Mistral 3 publish one checkpoint for text and images
(``…ForConditionalGeneration``: a vision tower, a projector and a causal language model; ``config.json``
holds a ``text_config`` and a ``vision_config``). Fuyou fine-tunes the language model on text: its config
is the checkpoint's ``text_config`` (``text_config``), and its tensors are read where the checkpoint
stores them (``TextPart``: under ``language_model.model.``/``language_model.lm_head.`` or
``model.language_model.``/``lm_head.``, the two layouts transformers writes). Every other tensor (vision
tower, projector, multi-token-prediction layers) is copied into the run's store at import, bit for bit,
and written back beside the trained text weights at export, with the checkpoint's own config, so
``from_pretrained`` of the exported directory loads the whole multimodal model.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fuyou.errors import ConfigError

PART_FILE = "multimodal.json"
"""In a store's model files: where the checkpoint kept its language model (``TextPart``'s prefixes)."""
UNTRAINED = "untrained"
"""Stem of the safetensors shards (and their index) that keep a multimodal checkpoint's other tensors."""

LAYOUTS = (
    ("language_model.model.", "language_model.lm_head."),  # Llama 4; Gemma 3 and Mistral 3 as published
    ("model.language_model.", "lm_head."),  # Qwen3.5; transformers' own layout since 4.52
)
"""(base model prefix, LM head prefix) of a language model inside a multimodal checkpoint, as stored."""


def is_multimodal(config: Any) -> bool:
    """True if ``config`` (a transformers config) describes a model with a vision tower and a text model."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "text_config", None) is not None


def text_config(config: Any) -> Any:
    """The config Fuyou trains with: ``config`` itself, or a multimodal config's ``text_config`` (a copy;
    its ``architectures`` left to the text model type's causal LM). Raises ConfigError if a multimodal
    config's text model is not a causal LM transformers knows."""
    if not is_multimodal(config):
        return config
    from fuyou.models.families import causal_lm_class

    text = copy.deepcopy(config.text_config)
    kind = getattr(text, "model_type", "") or ""
    if causal_lm_class(kind) is None:
        raise ConfigError(
            f"{config.model_type} is a vision-language model whose text model ({kind or '?'}) is no causal LM "
            "transformers knows; Fuyou trains decoder-only causal LMs and the text model of multimodal "
            "checkpoints whose text model is one"
        )
    text.architectures = None
    text.tie_word_embeddings = _tied(config)
    return text


def _tied(config: Any) -> bool:
    """Whether the multimodal model of ``config`` ties its LM head to the embedding: its own
    ``tie_word_embeddings`` where the head is its own module (``lm_head.weight`` among the class's tied
    keys: Gemma 3, Qwen3.5, Mistral 3), else the text model's (Llama 4's head is its causal LM's)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as NAMES

    cls = getattr(transformers, NAMES.get(config.model_type, ""), None)
    own = "lm_head.weight" in (getattr(cls, "_tied_weights_keys", None) or {})
    return bool(getattr(config if own else config.text_config, "tie_word_embeddings", False))


def is_multimodal_store(files: str) -> bool:
    """True if a store's model files ``files`` keep a multimodal checkpoint's other parts (``PART_FILE``)."""
    return os.path.isfile(os.path.join(files, PART_FILE))


@dataclass(frozen=True)
class TextPart:
    """Where a multimodal checkpoint keeps its language model: the on-disk prefixes of what Fuyou calls
    ``model.…`` (the base model) and ``lm_head.…``."""

    model_prefix: str
    head_prefix: str

    def disk_key(self, key: str) -> str:
        """``key`` (a text model's parameter name) as the checkpoint stores it."""
        if key.startswith("model."):
            return self.model_prefix + key[len("model.") :]
        if key.startswith("lm_head."):
            return self.head_prefix + key[len("lm_head.") :]
        return key

    def text_key(self, disk_key: str) -> str:
        """The text model's name of the tensor ``disk_key`` (one ``owns``): ``disk_key``'s inverse."""
        if disk_key.startswith(self.model_prefix):
            return "model." + disk_key[len(self.model_prefix) :]
        if disk_key.startswith(self.head_prefix):
            return "lm_head." + disk_key[len(self.head_prefix) :]
        raise KeyError(f"{disk_key} is not in the language model ({self.model_prefix}…, {self.head_prefix}…)")

    def owns(self, disk_key: str) -> bool:
        """True if the checkpoint's tensor ``disk_key`` belongs to the language model Fuyou trains."""
        return disk_key.startswith((self.model_prefix, self.head_prefix))

    def save(self, directory: str) -> None:
        """Record the prefixes in ``directory/PART_FILE`` (a store's model files)."""
        with open(os.path.join(directory, PART_FILE), "w") as f:
            json.dump({"model_prefix": self.model_prefix, "head_prefix": self.head_prefix}, f)


def find_text_part(model_dir: str, keys: Iterable[str]) -> TextPart | None:
    """The ``TextPart`` of the checkpoint in ``model_dir`` whose tensors are ``keys``: the one recorded in a
    store's model files (``PART_FILE``), else the first of ``LAYOUTS`` whose embedding is among ``keys``
    if the checkpoint's ``config.json`` is multimodal; None for a text-only checkpoint. Raises
    ModelFileError for a multimodal checkpoint that keeps its embedding under neither layout."""
    recorded = os.path.join(model_dir, PART_FILE)
    if os.path.isfile(recorded):
        with open(recorded) as f:
            d = json.load(f)
        return TextPart(d["model_prefix"], d["head_prefix"])
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None  # load_config reports an unreadable config
    if not (raw.get("vision_config") and raw.get("text_config")):
        return None
    present = set(keys)
    for model_prefix, head_prefix in LAYOUTS:
        if model_prefix + "embed_tokens.weight" in present:
            return TextPart(model_prefix, head_prefix)
    from fuyou.models.hf_io import ModelFileError

    tried = " or ".join(p + "embed_tokens.weight" for p, _ in LAYOUTS)
    raise ModelFileError(
        f"{model_dir} is a multimodal checkpoint without its language model's embedding ({tried}); "
        "pass the checkpoint as published, or its text model alone"
    )


def runtime_part(config: Any) -> TextPart:
    """Where transformers' model of the multimodal ``config`` holds its language model, by module name
    (what a PEFT adapter of it names: Gemma 3's ``model.language_model.``, stored as
    ``language_model.model.``): read from the model class built on the meta device. Raises ConfigError if
    transformers has no image-text-to-text model of ``config`` or it holds no such language model."""
    import torch
    from transformers import AutoModelForImageTextToText

    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
    except ValueError as e:
        raise ConfigError(f"transformers has no multimodal model of {config.model_type}: {e}") from None
    return model_part(model)


def model_part(model: Any) -> TextPart:
    """Where the multimodal transformers ``model`` (an instance) holds its language model, by module name.
    Raises ConfigError if it holds no base model of its text model's type and LM head."""
    from fuyou.models.families import base_model_class

    base = base_model_class(model.config.text_config.model_type)
    head = model.get_output_embeddings()
    names = {type(m): n for n, m in model.named_modules() if isinstance(m, base)}
    heads = [n for n, m in model.named_modules() if m is head]
    if base not in names or not heads:
        raise ConfigError(f"{type(model).__name__} holds no {base.__name__} and LM head Fuyou can name")
    return TextPart(names[base] + ".", heads[0] + ".")
