"""One GPU through the data-parallel path (torchrun's environment, NCCL, ``FUYOU_COLLECTIVES=1``):
the same training as one process without collectives."""

import pytest
import torch

from tests.integration.test_data_parallel import launch

pytestmark = pytest.mark.gpu


def test_one_gpu_through_nccl_matches_one_process(tmp_path):
    spec = dict(steps=3, batch=4, K=2, world=1, clip=1.0, device="cuda", policy="swap_cpu")
    (one,) = launch(spec, 1, tmp_path / "one")
    (ranked,) = launch(spec, 1, tmp_path / "ranked", {"FUYOU_COLLECTIVES": "1"}, ranked=True)
    assert ranked["ranked"] and not one["ranked"]
    assert ranked["losses"] == pytest.approx(one["losses"], rel=1e-6)
    for k, v in one["weights"].items():
        torch.testing.assert_close(ranked["weights"][k], v, rtol=1e-6, atol=1e-6, msg=k)
