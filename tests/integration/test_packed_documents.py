"""Packed documents (``--packing documents``): a sequence packing several documents trains as the
documents would unpacked, each in its own (right-padded) sequence — the same loss and gradient norm
at every step (fp32). Weights are not compared element by element: the two batches sum the same
gradients in another order, and Adam's first steps turn the rounding of near-zero gradients into
±lr moves; the later steps' equal losses show the updates agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fuyou.data.packing import pack
from fuyou.engine import Engine, EngineConfig, Plan
from tests.integration.tiny_models import VOCAB, tiny

LENGTHS = (9, 7, 5, 11)  # two sequences of 16 tokens: [9 + 7], [5 + 11]


def documents(seed: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [(ids := torch.randint(0, VOCAB, (n,), generator=g).tolist(), list(ids)) for n in LENGTHS]


def packed_batch(seed: int) -> tuple[torch.Tensor, ...]:
    seqs = list(pack(iter(documents(seed)), 16, documents=True))
    return tuple(torch.from_numpy(np.stack([s[i] for s in seqs])) for i in range(3))


def unpacked_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    labels = torch.full((len(LENGTHS), width), -100, dtype=torch.long)
    for r, (a, b) in enumerate(documents(seed)):
        ids[r, : len(a)], labels[r, : len(b)] = torch.tensor(a), torch.tensor(b)
    return ids, labels


def train(family: str, tmp_path, batches, K: int, positions: bool) -> tuple[list[float], list[float]]:
    cfg, model = tiny(family)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),), precision="fp32", lr=1e-3, weight_decay=0.01, cpu_memory="256MiB",
        max_grad_norm=1.0, plan=Plan(grad_accum=K),
    )  # fmt: skip
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        steps = [eng.train_step(b[0], b[1], b[2] if positions else None) for b in batches]
        return [st.loss for st in steps], [st.grad_norm for st in steps]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_documents_train_as_the_documents_unpacked(tmp_path, family) -> None:
    packed = [packed_batch(s) for s in range(3)]
    assert packed[0][2][0].tolist() == list(range(9)) + list(range(7))  # positions restart per document
    (tmp_path / "p").mkdir(), (tmp_path / "u").mkdir(), (tmp_path / "c").mkdir()
    lp, gp = train(family, tmp_path / "p", packed, 1, positions=True)
    lu, gu = train(family, tmp_path / "u", [unpacked_batch(s) for s in range(3)], 2, positions=False)
    assert lp == pytest.approx(lu, rel=1e-5) and gp == pytest.approx(gu, rel=1e-5)
    lc, gc = train(family, tmp_path / "c", packed, 1, positions=False)  # concat: documents see each other
    assert lc[0] != pytest.approx(lu[0], rel=1e-4) and gc[0] != pytest.approx(gu[0], rel=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2_sw", "gpt2"])
def test_masks_from_document_ids_equal_transformers_own_packed_masks(family) -> None:
    """The masks Fuyou makes from the documents it found on the host (``seed_context``) are exactly the
    ones ``transformers`` makes when it inspects ``position_ids`` itself (full and sliding windows,
    sdpa and eager attention), and a row of one document gets the plain causal mask."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    from fuyou.models.adapters import _make_mask, attention_kernel, seed_context

    cfg, _ = tiny(family)
    cfg._attn_implementation = attention_kernel(cfg)
    pos = packed_batch(0)[2]
    embeds = torch.zeros(*pos.shape, 8)
    seed = seed_context(pos, torch.device("cpu"))
    assert seed is not None and seed.documents is not None
    for make in (create_causal_mask, create_sliding_window_causal_mask):
        if make is create_sliding_window_causal_mask and getattr(cfg, "sliding_window", None) is None:
            continue
        theirs = make(cfg, embeds, None, None, position_ids=pos)
        ours = _make_mask(make, cfg, embeds, seed.documents)
        assert theirs is not None and torch.equal(ours, theirs)


def test_seed_context_tells_plain_positions_from_packed_documents() -> None:
    from fuyou.models.adapters import seed_context

    cpu = torch.device("cpu")
    assert seed_context(torch.arange(6).repeat(2, 1), cpu) is None  # plain 0…t−1: as without position_ids
    cont = seed_context(torch.arange(3, 9).unsqueeze(0), cpu)  # one document continued from the last sequence
    assert cont is not None and cont.documents is None and cont.position_ids.tolist() == [[3, 4, 5, 6, 7, 8]]
    packed = seed_context(torch.tensor([[0, 1, 2, 0, 1, 0]]), cpu)
    assert packed is not None and packed.documents is not None
    assert packed.documents.tolist() == [[0, 0, 0, 1, 1, 2]]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_positions_cost_no_device_read_back_and_plain_ones_change_nothing(tmp_path, family, monkeypatch) -> None:
    """``transformers``' mask functions, given ``position_ids``, test them for packed documents with a
    device→host read (``find_packed_sequence_indices``: a sync per micro-batch on a GPU). Fuyou finds
    the documents on the host: no call of it, and no tensor is read back (``item``/``bool``) while the
    masks are made, with plain, packed or no positions; plain positions give the very same losses as
    none."""
    import transformers.masking_utils as mu

    import fuyou.models.adapters as adapters

    calls = {"find": 0, "read": 0}
    find = mu.find_packed_sequence_indices

    def counted_find(*a, **kw):
        calls["find"] += 1
        return find(*a, **kw)

    monkeypatch.setattr(mu, "find_packed_sequence_indices", counted_find)
    making = [False]
    for name in ("item", "__bool__"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **kw):
            if making[0]:
                calls["read"] += 1
            return _orig(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for name in ("_masks", "_causal_mask"):
        orig = getattr(adapters, name)

        def watched(*a, _orig=orig, **kw):
            making[0] = True
            try:
                return _orig(*a, **kw)
            finally:
                making[0] = False

        monkeypatch.setattr(adapters, name, watched)
    ids, labels, pos = packed_batch(0)
    plain = torch.arange(ids.shape[1]).expand_as(ids).clone()
    (tmp_path / "n").mkdir(), (tmp_path / "a").mkdir(), (tmp_path / "p").mkdir()
    none, _ = train(family, tmp_path / "n", [(ids, labels, None)] * 2, 2, positions=False)
    arange, _ = train(family, tmp_path / "a", [(ids, labels, plain)] * 2, 2, positions=True)
    train(family, tmp_path / "p", [(ids, labels, pos)], 2, positions=True)
    assert calls == {"find": 0, "read": 0}
    assert arange == none


def test_linear_attention_layers_refuse_packed_documents_in_one_line(tmp_path) -> None:
    """Qwen3.5's Gated DeltaNet layers carry a state through the whole row: packed documents cannot be
    kept apart there. The engine refuses position ids that restart within a row; ``--packing auto``
    packs concat for such a model (with a warning), ``documents`` is refused before any work."""
    from fuyou.errors import ConfigError, FuyouWarning
    from fuyou.run.data import packing_for

    cfg, model = tiny("qwen3_5_moe")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(ssd_dirs=(str(tmp_path),), precision="fp32", lr=1e-3, cpu_memory="256MiB")
    ids, labels, pos = packed_batch(0)
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        with pytest.raises(ConfigError, match="packed documents .* linear-attention layers"):
            eng.train_step(ids, labels, pos)
        assert eng.train_step(ids, labels).applied  # one document per row (concat) trains
    with pytest.raises(ConfigError, match="--packing documents cannot keep packed documents apart"):
        packing_for("documents", cfg)
    with pytest.warns(FuyouWarning, match="packs concat"):
        assert packing_for("auto", cfg) == "concat"
    assert packing_for("auto", tiny("llama")[0]) == "auto"
