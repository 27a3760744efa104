"""Models by hub id: resolution through a hub cache built here (no network), and the one-line errors."""

from __future__ import annotations

import os

import httpx2
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from fuyou.errors import ConfigError
from fuyou.models.hub import CONFIG_FILES, hub_error, is_hub_id, parse_hub_id, resolve_model
from tests.hub_cache import add_to_hub_cache


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A hub cache holding model ``org/tiny`` (at ``main`` and tag ``v1``), used offline as HF_HUB_CACHE /
    HF_HUB_OFFLINE=1 set it (huggingface_hub reads them into ``constants`` when it is imported)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "model.safetensors").write_bytes(b"weights")
    cache = str(tmp_path / "cache")
    main = add_to_hub_cache(cache, "org/tiny", str(src))
    v1 = add_to_hub_cache(cache, "org/tiny", str(src), revision="v1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache, main, v1


def test_parse_hub_id():
    assert parse_hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert parse_hub_id("meta-llama/Llama-3.2-1B@refs/pr/3") == ("meta-llama/Llama-3.2-1B", "refs/pr/3")
    for not_an_id in ("gpt2", "./org/name", "/abs/path", "a/b/c", "org/..", "org/name@", "llama-3-8b", ""):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_resolves_a_cached_model_offline(hub_cache):
    cache, main, v1 = hub_cache
    assert resolve_model("org/tiny") == main
    assert resolve_model("org/tiny@main") == main
    assert resolve_model("org/tiny@v1") == v1
    assert resolve_model(f"org/tiny@{os.path.basename(v1)}") == v1  # a commit hash
    assert resolve_model("org/tiny", CONFIG_FILES) == main
    assert os.path.realpath(os.path.join(main, "model.safetensors")).startswith(
        os.path.join(cache, "models--org--tiny")
    )


def test_a_model_without_safetensors_weights_is_refused(hub_cache, tmp_path):
    src = tmp_path / "bin-only"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"pickle")
    add_to_hub_cache(hub_cache[0], "org/bin-only", str(src))
    with pytest.raises(ConfigError, match="org/bin-only has no safetensors weights"):
        resolve_model("org/bin-only")
    assert os.path.isfile(
        os.path.join(resolve_model("org/bin-only", CONFIG_FILES), "config.json")
    )  # plan needs no weights


def test_a_local_path_wins(hub_cache, tmp_path, monkeypatch):
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/tiny") and resolve_model("org/tiny") == "org/tiny"
    assert resolve_model("no-slash-here") == "no-slash-here"  # not an id: the caller reports the missing directory


def test_missing_model_offline_is_one_line(hub_cache):
    cache = hub_cache[0]
    for source in ("org/absent", "org/tiny@v2"):
        with pytest.raises(ConfigError) as info:
            resolve_model(source)
        msg = str(info.value)
        assert "\n" not in msg and source in msg and "unset HF_HUB_OFFLINE" in msg and cache in msg


def _response(status: int) -> httpx2.Response:
    return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/x"))


@pytest.mark.parametrize(
    "error, words",
    [
        (GatedRepoError("gated", response=_response(403)), ("gated", "hf auth login", "HF_TOKEN")),
        (RepositoryNotFoundError("404", response=_response(404)), ("neither a local directory", "ORG/NAME")),
        (RevisionNotFoundError("404", response=_response(404)), ("no such revision", "'@'")),
        (HfHubHTTPError("500 Server Error", response=_response(500)), ("failed", "500 Server Error")),
    ],
    ids=["gated", "not-found", "revision", "http"],
)
def test_hub_failures_name_the_fix(error, words):
    msg = str(hub_error(error, "org/x"))
    assert "\n" not in msg and "org/x" in msg
    for w in words:
        assert w in msg, (w, msg)
    assert hub_error(ValueError("other"), "org/x") is None  # not a hub failure: passes through
