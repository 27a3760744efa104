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
