"""Bad buffers and bad hyper-parameters are refused with a clear error, before any write."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fuyou.errors import ConfigError, FuyouError
from fuyou.optim import AdamWHyper, OptimBufferError, adamw_step, adamw_step_reference
from fuyou.optim.args import step_coefficients

N = 64
BF16 = torch.bfloat16


def bufs(**override: torch.Tensor) -> dict[str, torch.Tensor]:
    b = {"master": torch.ones(N), "m": torch.zeros(N), "v": torch.zeros(N), "grad": torch.ones(N)}
    b.update(override)
    return b


BAD_BUFFERS = {
    "fp16 master": (bufs(master=torch.ones(N, dtype=torch.float16)), "master: dtype"),
    "fp64 grad": (bufs(grad=torch.ones(N, dtype=torch.float64)), "grad: dtype"),
    "mixed m/v": (bufs(m=torch.zeros(N, dtype=BF16)), "share one dtype"),
    "short v": (bufs(v=torch.zeros(N - 1)), "v: 63 elements"),
    "2-D grad": (bufs(grad=torch.ones(8, 8)), "flat contiguous"),
    "strided m": (bufs(m=torch.zeros(2 * N)[::2]), "flat contiguous"),
    "requires grad": (bufs(master=torch.ones(N, requires_grad=True)), "requires_grad"),
    "numpy grad": (bufs(grad=np.ones(N, dtype=np.float32)), "torch.Tensor"),  # type: ignore
}


@pytest.mark.parametrize("case", sorted(BAD_BUFFERS))
@pytest.mark.parametrize("fn", [adamw_step, adamw_step_reference], ids=["numba", "reference"])
def test_bad_buffers_raise(case: str, fn) -> None:  # type: ignore[no-untyped-def]
    b, message = BAD_BUFFERS[case]
    before = b["master"].detach().clone()
    with pytest.raises(OptimBufferError, match=message):
        fn(b["master"], b["m"], b["v"], b["grad"], lr=1e-3, step=1)
    assert torch.equal(b["master"].detach(), before)


def test_overlapping_buffers_raise() -> None:
    big = torch.zeros(2 * N)
    with pytest.raises(OptimBufferError, match="overlap"):
        adamw_step(torch.ones(N), big[:N], big[N // 2 : N // 2 + N], torch.ones(N), lr=1e-3, step=1)


def test_wrong_out_dtype_raises() -> None:
    b = bufs()
    with pytest.raises(OptimBufferError, match="out: dtype"):
        adamw_step(*b.values(), lr=1e-3, step=1, out=torch.empty(N))


@pytest.mark.parametrize(
    "kwargs,message",
    [({"lr": -1.0}, "lr=-1.0"), ({"lr": float("nan")}, "lr=nan"), ({"step": 0}, "step=0"),
     ({"step": 1.5}, "step=1.5"), ({"grad_scale": float("inf")}, "grad_scale=inf"),
     ({"chunk": 0}, "chunk=0")],
)  # fmt: skip
def test_bad_step_args_raise(kwargs: dict, message: str) -> None:
    args = {"lr": 1e-3, "step": 1, **kwargs}
    with pytest.raises(ConfigError, match=message):
        adamw_step(*bufs().values(), **args)


def test_bad_hyper_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as err:
        AdamWHyper(beta1=1.0, beta2=-0.1, eps=0.0, weight_decay=-1.0)
    for name in ("beta1", "beta2", "eps", "weight_decay"):
        assert name in str(err.value)
    assert isinstance(err.value, FuyouError)


def test_coefficients_are_torch_style_float32() -> None:
    k = step_coefficients(AdamWHyper(weight_decay=0.1), lr=0.01, step=2, grad_scale=0.5)
    assert k.decay == np.float32(1 - 0.01 * 0.1)
    assert k.neg_step_size == np.float32(-0.01 / (1 - 0.9**2))
    assert k.bc2_sqrt == np.float32((1 - 0.999**2) ** 0.5)
    assert all(isinstance(x, np.float32) for x in vars(k).values())
