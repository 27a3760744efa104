"""Models by Hugging Face hub id: ``ORG/NAME[@REVISION]`` → a local snapshot directory.

Resolution goes through ``huggingface_hub.snapshot_download``, so the hub's own cache
(``HF_HUB_CACHE`` / ``HF_HOME``), token (``HF_TOKEN`` or ``hf auth login``), offline switch
(``HF_HUB_OFFLINE=1``) and download progress bars apply. Only what Fuyou reads is fetched: the
config, the safetensors weights and the tokenizer. The snapshot is then read as any model directory
(the weights stream from the cache's files). An existing local path always wins over a hub id.
No torch here: ``fuyou plan`` uses it too.
"""

from __future__ import annotations

import os
import re

from fuyou.errors import ConfigError

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*.safetensors",  # transformers' shards; not e.g. Mistral's consolidated.safetensors (the same weights again)
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template.*",
    "*processor_config.json",  # a multimodal model's processors: Fuyou trains its text model, export keeps the rest
)
"""What a fine-tuning run needs of a model repository (``allow_patterns``)."""

CONFIG_FILES = ("config.json",)
"""What planning needs of a model repository."""

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision or None)`` if ``text`` reads as ``ORG/NAME[@REVISION]``, else None."""
    m = _HUB_ID.match(text)
    if m is None or ".." in m.group("repo") or m.group("repo").endswith((".", "-")):
        return None
    return m.group("repo"), m.group("rev")


def is_hub_id(source: str) -> bool:
    """True if ``source`` is no existing local path and reads as a hub id."""
    return not os.path.exists(source) and parse_hub_id(source) is not None


def resolve_model(source: str, files: tuple[str, ...] = MODEL_FILES, repo_type: str = "model") -> str:
    """The local directory of ``source``: itself if it exists (or is no hub id), else the snapshot of
    hub repository ``ORG/NAME[@REVISION]`` holding ``files`` (glob patterns), downloaded if needed.

    Raises ConfigError, in one line naming the fix, for an unknown repository or revision, a gated
    repository without access, a repository missing from the cache while offline, no network, or (with the
    default ``files``) a model without safetensors weights.
    """
    parsed = None if os.path.exists(source) else parse_hub_id(source)
    if parsed is None:
        return source
    repo_id, revision = parsed
    from huggingface_hub import snapshot_download

    try:
        path = str(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=list(files)))
    except Exception as e:  # noqa: BLE001 - each hub failure becomes one line below; others pass through
        err = hub_error(e, source, repo_type)
        if err is None:
            raise
        raise err from e
    if files == MODEL_FILES and not any(n.startswith("model") and n.endswith(".safetensors") for n in os.listdir(path)):
        raise ConfigError(
            f"model {source} has no safetensors weights in transformers' layout (model.safetensors or "
            "model-*-of-*.safetensors), which Fuyou reads; pick a revision or repository that has them"
        )
    return path


def _offline() -> bool:
    """Whether huggingface_hub runs offline (``HF_HUB_OFFLINE``, read as the library reads it)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_error(e: BaseException, source: str, repo_type: str = "model") -> ConfigError | None:
    """The one-line error for a failed hub resolution of ``source``, or None if ``e`` is no hub failure.

    Names the fix: log in or set ``HF_TOKEN`` (gated or private), check the id or revision, unset
    ``HF_HUB_OFFLINE`` or download it where there is a network (not cached), or point ``HF_HUB_CACHE``
    at the cache that holds it.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = "dataset" if repo_type == "dataset" else "model"
    cache = constants.HF_HUB_CACHE
    if isinstance(e, GatedRepoError):
        return ConfigError(
            f"{what} {source} is gated on the Hugging Face hub: accept its terms on its hub page, then log in "
            "(hf auth login) or set HF_TOKEN to a token of that account"
        )
    if isinstance(e, RepositoryNotFoundError):
        return ConfigError(
            f"{source} is neither a local directory nor a {what} on the Hugging Face hub; check the path or id "
            "(ORG/NAME), or for a private repository log in (hf auth login) or set HF_TOKEN"
        )
    if isinstance(e, RevisionNotFoundError):
        return ConfigError(f"{what} {source}: no such revision on the hub; check the branch, tag or commit after '@'")
    if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        where = f"{source} is no local path, and {what} {source} is not in the hub cache ({cache})"
        if _offline():
            return ConfigError(
                f"{where} while HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it, or point HF_HUB_CACHE "
                "at a cache that holds it"
            )
        return ConfigError(
            f"{where} and the hub cannot be reached; check the network (or HF_ENDPOINT), or point HF_HUB_CACHE "
            "at a cache that holds it"
        )
    if isinstance(e, HfHubHTTPError):
        return ConfigError(f"downloading {what} {source} from the hub failed: {' '.join(str(e).split())[:200]}")
    return None
