"""A Fuyou step equals a plain in-RAM PyTorch + AdamW step (fp32), under every plan."""

import pytest
import torch

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.models.adapters import make_adapter
from tests.integration.tiny_models import (
    MOE_FAMILIES,
    STANDARD,
    STANDARD_MOE,
    batches,
    hf_balance,
    reference_steps,
    tiny,
)

LR, WD, STEPS = 1e-3, 0.01, 5


def run_fuyou(
    cfg,
    model,
    tmp_path,
    data,
    *,
    policy="recompute",
    K=1,
    depth=2,
    ndirs=1,
    clip=0.0,
    precision="fp32",
    lrs=None,
    device="cpu",
):
    dirs = []
    for i in range(ndirs):
        d = tmp_path / f"ssd{i}"
        d.mkdir()
        dirs.append(str(d))
    nblocks = len(make_adapter(cfg).blocks)  # LongCat-Flash: num_hidden_layers counts each layer's two sublayers
    plan = Plan(grad_accum=K, prefetch_depth=depth, activation_policy=("keep",) + (policy,) * (nblocks - 2) + ("keep",))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(
        ssd_dirs=tuple(dirs),
        device=device,
        precision=precision,
        lr=LR,
        weight_decay=WD,
        cpu_memory="256MiB",
        max_grad_norm=clip,
        plan=plan,
    )
    losses = []
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        for i, (ids, labels) in enumerate(data):
            if lrs:
                eng.set_lr(lrs[i])
            st = eng.train_step(ids, labels)
            assert st["applied"]
            losses.append(st["loss"])
        weights = dict(eng.master_weights())
    return losses, weights


# The key-projection bias has an identically zero gradient (softmax is invariant to adding the same
# q·b to every score of a query), so Adam turns fp32 rounding noise into ±lr steps: it cannot be
# compared at 1e-5. It is bounded instead by what Adam can move it: lr per step.
def zero_grad_part(key: str, t: torch.Tensor) -> torch.Tensor:
    """Mask of the key-bias elements: all of Llama-style ``k_proj.bias``, the middle third of GPT-2's ``c_attn.bias``."""
    mask = torch.zeros_like(t, dtype=torch.bool)
    if key.endswith("k_proj.bias"):
        mask[:] = True
    elif key.endswith("c_attn.bias"):
        n = t.numel() // 3
        mask[n : 2 * n] = True
    return mask


def assert_same(ref_model, ref_losses, losses, weights, tol=1e-5, ill=None, max_ill=0.1):
    """Losses and fp32 weights within ``tol``; a key bias (``zero_grad_part``) and the elements in
    ``ill`` (``reference_steps``: gradients near zero at some step, at most ``max_ill`` of the model)
    within what Adam can move them."""
    assert losses == pytest.approx(ref_losses, rel=tol)
    sd = ref_model.state_dict()
    if ill is not None:
        assert sum(int(m.sum()) for m in ill.values()) <= max_ill * sum(m.numel() for m in ill.values())
    for k, w in weights.items():
        ref = sd[k]
        diff = (w - ref).abs()
        zero = zero_grad_part(k, ref) | (ill[k] if ill is not None and k in ill else False)
        assert diff[zero].max().item() <= 2 * LR * len(losses) if zero.any() else True, k
        if (~zero).any():
            assert diff[~zero].max().item() <= tol * ref[~zero].abs().max().item() + 1e-12, k
    tied_alias = {"lm_head.weight"}
    assert set(sd) - set(weights) <= tied_alias


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2", "gpt2", "phi3"])
@pytest.mark.parametrize("policy", ["keep", "swap_cpu", "swap_ssd", "recompute"])
def test_families_and_policies(tmp_path, family, policy):
    cfg, model = tiny(family)
    data = batches(STEPS)
    losses, weights = run_fuyou(cfg, model, tmp_path, data, policy=policy)
    ref_losses = reference_steps(model, data, 1, LR, WD)
    assert_same(model, ref_losses, losses, weights)


@pytest.mark.parametrize(
    "family",
    [
        *("mistral_sw", "qwen2_sw", "llama31", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "glm4_moe"),
        *("deepseek_v3", "llama4", "qwen3_5_moe", pytest.param("qwen3_5", marks=pytest.mark.slow)),
        pytest.param("qwen3_next", marks=pytest.mark.slow),
        *("gemma", "gemma2", "gemma3", "gemma4", "gemma4_moe"),
    ],
)
@pytest.mark.parametrize("policy", ["keep", pytest.param("recompute", marks=pytest.mark.slow)])
def test_more_families(tmp_path, family, policy):
    """Mistral's sliding window (every layer) and Qwen2's (layers past ``max_window_layers``): 4-token
    windows over 16-token sequences, so a full causal mask would train another model; Llama 3.1's RoPE
    scaling past 8 original positions; mixtures of experts (4 experts, top 2; Qwen2-MoE's shared
    expert) with the default balance loss (``global``: over both micro-batches, ``transformers``' own
    function over their router logits at once); clipping and accumulation on; GLM-4.5
    and DeepSeek-V3 (a routing bias instead of a balance loss, a shared expert, a dense first layer;
    DeepSeek-V3's multi-head latent attention); Llama 4 (chunked attention, a NoPE layer, a mixture of
    experts every other layer that runs every expert, a shared expert); Qwen3.5-MoE (Gated DeltaNet
    linear-attention layers, then gated full attention); Gemma 4 (``tiny_models.tiny_gemma4``: tied dense,
    and untied with a mixture beside the MLP; it has no balance loss)."""
    cfg, model = tiny(family, layers=3)
    data = batches(STEPS)
    losses, weights = run_fuyou(cfg, model, tmp_path, data, policy=policy, K=2, clip=0.5)
    balance = hf_balance(cfg)
    near_zero = MOE_FAMILIES + ("qwen3_5", "gemma4", "gemma4_moe")  # near-zero gradients: as the standard shapes
    ill = {} if family in near_zero else None
    ref = reference_steps(model, data, 2, LR, WD, clip=0.5, balance=balance, ill=ill)
    assert_same(model, ref, losses, weights, ill=ill)


FAST_STANDARD = ("olmo2", "glm4", "smollm3_tied", "starcoder2")
"""Standard-shape families the default tier proves (RMSNorm after the sublayers, partial rotary, NoPE
layers and a tied head, LayerNorm with biases); the slow tier proves the rest."""


@pytest.mark.parametrize(
    "family",
    [f if f in FAST_STANDARD else pytest.param(f, marks=pytest.mark.slow) for f in (*STANDARD, "smollm3_tied")],
)
def test_standard_shape_families_through_the_generic_adapter(tmp_path, family):
    """Families with no code of their own (``fuyou.models.families.STANDARD``): their layers, masks and
    rotary tables as the library runs them, 3 layers, clipping and accumulation on. Elements whose
    gradient is near zero at some step (``ill``: embedding rows of rare tokens) are held to what Adam
    can move them, as for the mixtures of experts."""
    cfg, model = tiny(family, layers=3)
    data = batches(STEPS)
    losses, weights = run_fuyou(cfg, model, tmp_path, data, policy="keep", K=2, clip=0.5)
    ill: dict = {}
    ref = reference_steps(model, data, 2, LR, WD, clip=0.5, ill=ill)
    assert_same(model, ref, losses, weights, ill=ill)


@pytest.mark.parametrize(
    "family", [f if f == "glm_moe_dsa" else pytest.param(f, marks=pytest.mark.slow) for f in STANDARD_MOE]
)
def test_standard_shape_mixtures_of_experts_through_the_generic_adapter(tmp_path, family):
    """Mixtures of experts with no code of their own (``fuyou.models.families.STANDARD_MOE``): the
    family's balance loss where it has one (``global``, as the HF function over both micro-batches),
    its routing bias where it has that instead, DeepSeek-V2's and GLM-4 MoE Lite's latent attention;
    3 layers, clipping and accumulation on. GLM-5 (default tier): its second layer attends to the keys
    its first layer's indexer picked (``families.HANDED_ON``). FlexOlmo's tiny routers leave 10.3 % of its elements
    ill-conditioned (``ill``), held to what Adam can move them."""
    cfg, model = tiny(family, layers=3)
    data = batches(STEPS)
    losses, weights = run_fuyou(cfg, model, tmp_path, data, policy="keep", K=2, clip=0.5)
    balance = hf_balance(cfg)
    ill: dict = {}
    ref = reference_steps(model, data, 2, LR, WD, clip=0.5, balance=balance, ill=ill)
    assert_same(model, ref, losses, weights, ill=ill, max_ill=0.11 if family == "flex_olmo" else 0.1)


@pytest.mark.parametrize("vocab_groups", [1, 2])
def test_afmoe_scales_its_embeddings_where_its_config_says(tmp_path, vocab_groups):
    """AFMoE's base model multiplies the embeddings by √hidden when ``mup_enabled`` (muP input scaling),
    outside the embedding module (``families.embedding_scale``): on, the embedding whole and split by
    vocabulary rows (each group's rows scaled), it trains as transformers + AdamW; off, the standard-shape
    test above proves it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tests.integration.tiny_models import causal_lm, tiny_standard_moe

    cfg, _ = tiny_standard_moe("afmoe", layers=3)
    cfg.mup_enabled = True
    torch.manual_seed(0)
    model = causal_lm(CONFIG_MAPPING["afmoe"](**cfg.to_dict())).float().train()
    assert model.config.mup_enabled
    data = batches(STEPS)
    n = len(make_adapter(cfg, vocab_groups=vocab_groups).blocks)
    plan = Plan(grad_accum=2, vocab_groups=vocab_groups, activation_policy=("keep",) * n)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(ssd_dirs=(str(tmp_path),), precision="fp32", lr=LR, weight_decay=WD, max_grad_norm=0.5, plan=plan)
    with Engine.from_state_dict(model.config, sd, ec) as eng:
        losses = [eng.train_step(ids, labels).loss for ids, labels in data]
        weights = dict(eng.master_weights())
    ill: dict = {}
    ref = reference_steps(model, data, 2, LR, WD, clip=0.5, balance=hf_balance(cfg), ill=ill)
    tol = 1e-5 if vocab_groups == 1 else 3e-5  # the split head's log-sum-exp (``test_vocab_split.TOL``)
    assert_same(model, ref, losses, weights, tol=tol, ill=ill)


@pytest.mark.parametrize("family", ["llama_tied", "gpt2"])
def test_recompute_with_block_inputs_in_host_memory(tmp_path, family):
    """recompute_cpu: block inputs copied off the device after forward and back one micro-batch
    ahead of backward (K = 2: the second micro-batch's input is uploaded during the first's backward,
    the next block's first during the second's)."""
    cfg, model = tiny(family)
    data = batches(STEPS)
    losses, weights = run_fuyou(cfg, model, tmp_path, data, policy="recompute_cpu", K=2)
    assert_same(model, reference_steps(model, data, 2, LR, WD), losses, weights)


@pytest.mark.parametrize("family", ["llama_tied", "gpt2"])
@pytest.mark.parametrize("tokens, tol", [(16, 1e-5), (10, 1e-3)])
def test_loss_in_token_chunks_equals_the_whole_micro_batch(tmp_path, monkeypatch, family, tokens, tol):
    """The LM head's loss runs in chunks of ``sizing.loss_chunk_tokens`` tokens (so fp32 logits never
    fill the device). Micro-batches of 2 sequences × 16 tokens: chunks of 16 tokens cut each sequence in
    two even pieces; chunks of 10 in pieces of 5, 5, 5, 1. The step still equals plain PyTorch: at the
    suite's 1e-5 for even pieces; uneven ones sum the head's gradients in another order (1.5e-7
    relative, fp32 rounding), which Adam's division by √v amplifies for small gradients: on an AVX-512
    CPU up to 1.5e-4 of the largest weight after 3 steps, 1.4e-3 of it where a gradient is near zero
    (those elements are held to what Adam can move them)."""
    from fuyou.schedule import sizing
    from tests.integration.tiny_models import VOCAB

    monkeypatch.setattr(sizing, "LOSS_CHUNK_BYTES", tokens * (8 + 2 * 4) * VOCAB)
    assert sizing.loss_chunk_tokens(VOCAB, 4) == tokens
    cfg, model = tiny(family)
    data = batches(3)
    losses, weights = run_fuyou(cfg, model, tmp_path, data, K=2)
    # where a gradient is near zero, the summation order decides Adam's step (seen on AVX-512 CPUs: 5e-5 of
    # GPT-2's weights); there, half of GPT-2's fused c_attn (its key projection, whose gradients softmax
    # all but cancels) is such, 11 % of the model
    ill: dict = {}
    ref = reference_steps(model, data, 2, LR, WD, ill=ill)
    assert_same(model, ref, losses, weights, tol=tol, ill=ill, max_ill=0.15)


@pytest.mark.parametrize("K,depth,ndirs", [(4, 1, 1), (4, 3, 2), (1, 3, 2), (2, 1, 2)])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_accumulation_prefetch_stripes_and_schedules(tmp_path, K, depth, ndirs, clip):
    cfg, model = tiny("llama_tied", layers=3)
    data = batches(STEPS)
    lrs = [LR * (1 - 0.15 * i) for i in range(STEPS)]  # an LR schedule: changes every step
    losses, weights = run_fuyou(
        cfg,
        model,
        tmp_path,
        data,
        K=K,
        depth=depth,
        ndirs=ndirs,
        clip=clip,
        lrs=lrs,
        policy={2: "keep", 3: "swap_ssd"}.get(K if K == 2 else depth, "recompute"),
    )
    ref_losses = reference_steps(model, data, K, LR, WD, clip=clip, lrs=lrs)
    assert_same(model, ref_losses, losses, weights)


def reference_bf16_steps(model, data, device="cpu"):
    """The bf16 recipe written plainly in PyTorch on ``device``: bf16 compute weights, fp32 master
    weights and AdamW, the new master copied into the compute weights after each step. Converts
    ``model`` to bf16 on ``device`` in place; returns (losses, fp32 master weights by name, on the CPU)."""
    master = {k: v.detach().clone().float().to(device) for k, v in model.state_dict().items()}
    work = model.to(device=device, dtype=torch.bfloat16)
    params = [torch.nn.Parameter(master[k]) for k, _ in work.named_parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    losses = []
    for ids, labels in data:
        ids, labels = ids.to(device), labels.to(device)
        n = int((labels[:, 1:] != -100).sum())
        work.zero_grad()
        loss = work(input_ids=ids, labels=labels, num_items_in_batch=n).loss
        loss.backward()
        losses.append(loss.item())
        for p, (_, wp) in zip(params, work.named_parameters()):
            p.grad = wp.grad.float()
        opt.step()
        with torch.no_grad():
            for p, (_, wp) in zip(params, work.named_parameters()):
                wp.copy_(p)
    return losses, {k: p.detach().cpu() for (k, _), p in zip(work.named_parameters(), params)}


def assert_bf16_close(losses, weights, ref_losses, ref):
    """Fuyou's bf16 run against ``reference_bf16_steps``, within bf16's rounding."""
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    # bf16 tolerance: bf16 gradients carry ~0.4 % relative error, and Adam turns a near-zero gradient
    # of either sign into a ±lr step, so a few elements differ by up to 2·lr·steps while the bulk
    # agrees to ~0.1 % of the weights' scale.
    for k, w in weights.items():
        r = ref[k]
        d = (w - r).abs()
        assert d.mean().item() <= 3e-3 * r.abs().mean().item(), k
        assert d.max().item() <= 2 * LR * len(losses) + 1e-2 * r.abs().max().item(), k
        assert (d > 1e-4).float().mean().item() <= 0.03, k


def test_bf16_mixed_precision_matches_reference_mixed_precision_loop(tmp_path):
    """bf16 compute weights + fp32 master vs the same recipe written plainly in PyTorch."""
    cfg, model = tiny("llama")
    data = batches(3)
    losses, weights = run_fuyou(cfg, model, tmp_path, data, precision="bf16")
    assert_bf16_close(losses, weights, *reference_bf16_steps(model, data))


@pytest.mark.parametrize("family, chunk", [("llama_tied", None), ("gpt2", None), ("llama_tied", 5)])
def test_evaluate_matches_model_loss_and_does_not_update(tmp_path, monkeypatch, family, chunk):
    """The held-out loss equals the model's; its logits are made ``loss_chunk_tokens`` at a time (``chunk``:
    5 tokens, uneven pieces of each sequence), as in training; the device allocator running out is the
    one-line DeviceMemoryError."""
    from fuyou.errors import DeviceMemoryError
    from fuyou.schedule import sizing
    from tests.integration.tiny_models import VOCAB

    if chunk:
        monkeypatch.setattr(sizing, "LOSS_CHUNK_BYTES", chunk * 2 * (8 + 2 * 4) * VOCAB)  # 2 sequences a batch
    cfg, model = tiny(family)
    ids, labels = batches(1)[0]
    labels = labels.clone()
    labels[0, :3] = -100  # unlabelled positions count in neither the sum nor the mean
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(ssd_dirs=(str(tmp_path),), precision="fp32", cpu_memory="64MiB")
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        version = eng.store.version
        forward, heads = eng.adapter.forward, []
        H = len(eng.layout.blocks) - 1

        def counting(b, x, ctx):
            heads.extend([x.shape[1]] if b == H else [])
            return forward(b, x, ctx)

        monkeypatch.setattr(eng.adapter, "forward", counting)
        loss = eng.evaluate(ids, labels)
        assert eng.store.version == version and eng.step == 0
        assert heads == ([2] * 8 if chunk else [16])  # 4 sequences × 2 positions: 8 ≤ the 10 tokens a chunk holds
        if chunk:

            def oom(*_a, **_k):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

            monkeypatch.setattr(eng.adapter, "forward", oom)
            with pytest.raises(
                DeviceMemoryError, match=r"ran out of memory during an evaluation \(asking for 2.00 GiB with .* cap\)"
            ) as e:
                eng.evaluate(ids, labels)
            assert "\n" not in str(e.value)
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels).loss.item()
    assert loss == pytest.approx(ref, rel=1e-6)


def test_resume_from_store_continues_bit_identically(tmp_path):
    cfg, model = tiny("llama_tied")
    data = batches(4)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = lambda d: EngineConfig(ssd_dirs=(str(d),), precision="fp32", lr=LR, cpu_memory="64MiB", max_grad_norm=1.0)  # noqa: E731
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with Engine.from_state_dict(cfg, sd, ec(tmp_path / "a")) as eng:
        straight = [eng.train_step(*d)["loss"] for d in data]
        w_straight = dict(eng.master_weights())
    with Engine.from_state_dict(cfg, sd, ec(tmp_path / "b")) as eng:
        first = [eng.train_step(*d)["loss"] for d in data[:2]]
    with Engine.resume(ec(tmp_path / "b")) as eng:
        assert eng.step == 2
        rest = [eng.train_step(*d)["loss"] for d in data[2:]]
        w_resumed = dict(eng.master_weights())
    assert first + rest == straight
    assert all(torch.equal(w_straight[k], w_resumed[k]) for k in w_straight)


def test_a_token_id_outside_the_vocabulary_is_refused_before_the_step(tmp_path):
    """Data tokenized with another model's tokenizer: one line naming the id and the vocabulary, before the
    step runs (the lookup would fail deep inside it, or on a GPU with a device-side assert); nothing trained."""
    from fuyou.errors import ConfigError

    cfg, model = tiny("llama", layers=1)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(ssd_dirs=(str(tmp_path),), precision="fp32", cpu_memory="64MiB")
    ids = torch.full((2, 8), cfg.vocab_size - 1)
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        for bad in (cfg.vocab_size, -1):
            ids[1, 3] = bad
            with pytest.raises(
                ConfigError, match=rf"token id {bad} is outside the model's vocabulary of {cfg.vocab_size}"
            ):
                eng.train_step(ids)
            with pytest.raises(ConfigError, match="outside the model's vocabulary"):
                eng.evaluate(ids)
        assert eng.step == 0
