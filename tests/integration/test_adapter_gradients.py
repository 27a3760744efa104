"""The adapters' gradient fast paths against plain autograd: the sparse embedding backward and the LM
head's in-place weight-gradient accumulation, each added into a preset dense gradient (as the engine
runs them) micro-batch after micro-batch, equal the dense gradient of the plain model."""

import pytest
import torch

from fuyou.models.adapters import HeadLinear, make_adapter
from tests.integration.tiny_models import tiny


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_embed_block_gradient_equals_the_dense_reference(family):
    cfg, model = tiny(family)
    ad = make_adapter(cfg)
    ad.prepare(torch.device("cpu"))
    weights = {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if k.startswith(tuple(p for p, _ in ad.modules[0][1]))
    }
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 8, (2, 12), generator=g) for _ in range(2)]  # 8 distinct tokens: many repeats
    dys = [torch.randn(2, 12, ad.hidden, generator=g) for _ in range(2)]

    params = ad.bind(0, {k: v.clone() for k, v in weights.items()})
    for p in params.values():
        p.grad = torch.zeros_like(p)  # as the engine presets its flat gradient buffer
    for x, dy in zip(ids, dys):
        y, _ = ad.forward(0, x, None)
        y.backward(dy)
    ad.unbind(0)

    ref = {k: v.clone().requires_grad_() for k, v in weights.items()}
    for x, dy in zip(ids, dys):
        emb = torch.nn.functional.embedding(x, ref[ad.embed_key])
        if family == "gpt2":
            emb = emb + torch.nn.functional.embedding(torch.arange(12).unsqueeze(0), ref["transformer.wpe.weight"])
        emb.backward(dy)
    for k, p in params.items():
        assert not p.grad.is_sparse, k
        torch.testing.assert_close(p.grad, ref[k].grad, rtol=1e-6, atol=1e-6)
    assert params[ad.embed_key].grad[8:].abs().sum() == 0  # rows of tokens not in the batch stay zero

    params = ad.bind(0, {k: v.clone() for k, v in weights.items()})  # no preset gradient: it stays sparse
    ad.forward(0, ids[0], None)[0].backward(dys[0])
    assert params[ad.embed_key].grad.is_sparse
    ad.unbind(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_linear_accumulates_into_the_preset_gradient(dtype):
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(50, 16, generator=g) * 0.1).to(dtype)
    hs = [torch.randn(2, 7, 16, generator=g).to(dtype) for _ in range(3)]
    dys = [torch.randn(2, 7, 50, generator=g).to(dtype) for _ in range(3)]
    fast = torch.nn.Parameter(w.clone())
    fast.grad = torch.zeros_like(w)
    ref = w.clone().requires_grad_()
    for h, dy in zip(hs, dys):
        hf, hr = h.clone().requires_grad_(), h.clone().requires_grad_()
        y = HeadLinear.apply(hf, fast)
        torch.testing.assert_close(y, torch.nn.functional.linear(hr, ref), rtol=0, atol=0)
        y.backward(dy)
        torch.nn.functional.linear(hr, ref).backward(dy)
        torch.testing.assert_close(hf.grad, hr.grad)
    # one rounding per micro-batch (GEMM then add in the gradient's dtype) against two in plain autograd
    scale = float(ref.grad.abs().max())
    tol = dict(rtol=0, atol=scale * 2**-7) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6 * scale)
    torch.testing.assert_close(fast.grad, ref.grad, **tol)
    exact = sum(dy.reshape(-1, 50).double().t() @ h.reshape(-1, 16).double() for h, dy in zip(hs, dys))
    assert (fast.grad.double() - exact).abs().max() <= (ref.grad.double() - exact).abs().max() * 1.01 + 1e-12

    bare = torch.nn.Parameter(w.clone())  # no preset gradient: autograd's own accumulation
    HeadLinear.apply(hs[0], bare).backward(dys[0])
    torch.testing.assert_close(bare.grad, dys[0].reshape(-1, 50).t() @ hs[0].reshape(-1, 16), rtol=0, atol=0)
