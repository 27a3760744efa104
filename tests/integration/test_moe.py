"""Mixture-of-experts checkpoints as transformers writes them (one tensor per expert on disk, Mixtral's
``block_sparse_moe`` module name) stream into Fuyou's fused expert tensors, train as the HF model
trains (fp32, with the default global balance loss), and export a directory transformers loads back
to the same weights."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from fuyou.engine import Engine, EngineConfig, Plan
from tests.integration.test_engine_fidelity import LR, STEPS, WD, assert_same
from tests.integration.tiny_models import STANDARD_MOE, batches, hf_balance, reference_steps, tiny, tiny_standard_moe


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3", "minimax_m2"])
def test_moe_checkpoint_trains_as_transformers_and_exports_what_it_loads(tmp_path, family):
    """DeepSeek-V3 and MiniMax-M2: their routing bias (``e_score_correction_bias``, a buffer: the router's
    in DeepSeek's checkpoints, the MoE block's in MiniMax's) comes from the checkpoint, steers the routing
    (drawn at random here, as a trained one) and leaves untouched. MiniMax-M2 runs through the generic
    adapter, its checkpoint in the published layout (``block_sparse_moe.experts.N.w1``)."""
    cfg, model = tiny_standard_moe(family, layers=3) if family == "minimax_m2" else tiny(family)
    src = tmp_path / "src"
    model.save_pretrained(src)
    with safe_open(str(src / "model.safetensors"), "pt") as f:  # per-expert tensors on disk, not the fused
        keys = list(f.keys())
        assert any(".experts.0." in k for k in keys) != (family == "gpt_oss")  # ones; GPT-OSS's are fused
        assert any(".block_sparse_moe." in k for k in keys) == (family in ("mixtral", "minimax_m2"))
    (tmp_path / "ssd").mkdir()
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path / "ssd"),), precision="fp32", lr=LR, weight_decay=WD, cpu_memory="256MiB",
        plan=Plan(grad_accum=2),
    )  # fmt: skip
    data = batches(STEPS)
    with Engine.from_pretrained(str(src), ec) as eng:
        losses = [eng.train_step(ids, labels).loss for ids, labels in data]
        weights = dict(eng.master_weights())
        eng.export(str(tmp_path / "out"), dtype="fp32")
    ill: dict = {}
    balance = hf_balance(cfg)
    assert_same(model, reference_steps(model, data, 2, LR, WD, balance=balance, ill=ill), losses, weights, ill=ill)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(loaded[k], w) for k, w in weights.items())
    buffers = [k for k in model.state_dict() if k.endswith("e_score_correction_bias")]
    assert len(buffers) == {"deepseek_v3": 1, "minimax_m2": 3}.get(family, 0)
    assert all(torch.equal(loaded[k], model.state_dict()[k]) for k in buffers)


def _mxfp4_checkpoint(path) -> None:
    """A tiny GPT-OSS checkpoint as OpenAI publishes the real ones: every expert tensor MXFP4-packed
    (``*_blocks``: random 4-bit codes two to a byte, 32 to a block; ``*_scales``: a biased exponent per
    block), the rest bf16, ``quantization_config`` naming mxfp4."""
    from safetensors.torch import save_file

    cfg, model = tiny("gpt_oss")
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for k, v in model.state_dict().items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, rows_in, rows_out = v.shape  # stored transposed, in blocks of 32 input rows
            tensors[k + "_blocks"] = torch.randint(
                0, 256, (experts, rows_out, rows_in // 32, 16), dtype=torch.uint8, generator=gen
            )
            tensors[k + "_scales"] = torch.randint(
                118, 128, (experts, rows_out, rows_in // 32), dtype=torch.uint8, generator=gen
            )
        else:
            tensors[k] = v.detach().to(torch.bfloat16).contiguous()
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.quantization_config = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"],
    }
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(path)


def test_mxfp4_experts_import_as_transformers_dequantizes_them_and_export_unquantized(tmp_path):
    from transformers import Mxfp4Config

    src = tmp_path / "src"
    _mxfp4_checkpoint(src)
    ref = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16
    )
    # bit for bit: every MXFP4 value is exact in bf16 and in the fp32 master
    import_train_export(tmp_path, src, ref.state_dict(), "bf16")


def import_train_export(tmp_path, src, want: dict, precision: str) -> None:
    """Import the checkpoint ``src``: its masters equal ``want`` (transformers' dequantized load) bit for
    bit; one step trains; the fp32 export loads in transformers as plain tensors, equal to the masters."""
    (tmp_path / "ssd").mkdir()
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path / "ssd"),), precision=precision, lr=LR, weight_decay=WD, cpu_memory="256MiB"
    )
    with Engine.from_pretrained(str(src), ec) as eng:
        got = dict(eng.master_weights())
        assert set(got) == set(want)
        for k, w in got.items():
            assert torch.equal(w, want[k].float()), k
        ids, labels = batches(1)[0]
        assert eng.train_step(ids, labels).applied
        trained = dict(eng.master_weights())
        eng.export(str(tmp_path / "out"), dtype="fp32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # no quantization_config: plain tensors
    assert all(torch.equal(loaded.state_dict()[k], w) for k, w in trained.items())


def _fp8_checkpoint(path, block: int, family: str = "deepseek_v3") -> None:
    """A tiny checkpoint of ``family`` as DeepSeek (DeepSeek-V3) and MiniMax (MiniMax-M2) publish the real
    ones: the on-disk layout transformers writes (one tensor per expert; MiniMax's ``block_sparse_moe``),
    every linear weight but the router's and the head's float8 (e4m3) with an fp32 scale per
    ``block`` × ``block`` tile (``weight_scale_inv``, the last tiles partial), the rest bf16 but the
    fp32 routing bias; ``quantization_config`` naming fp8 and the block."""
    from safetensors.torch import save_file

    _, model = tiny(family, layers=3) if family == "deepseek_v3" else tiny_standard_moe(family, layers=3)
    model.save_pretrained(path)  # the published layout: transformers reverts its conversions on save
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for k, w in tensors.items():
        if w.ndim == 2 and "embed" not in k and "lm_head" not in k and not k.endswith(".gate.weight"):
            r, c = w.shape
            tiles = torch.zeros(-(-r // block) * block, -(-c // block) * block)
            tiles[:r, :c] = w
            t = tiles.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [R, b, C, b]
            scale = t.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            q = (t / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:r, :c]
            out[k], out[k + "_scale_inv"] = q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()
        else:
            out[k] = w.float() if k.endswith("e_score_correction_bias") else w.to(torch.bfloat16).contiguous()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config
    cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block] * 2}
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(path)


@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m2"])
def test_fp8_weights_import_as_transformers_dequantizes_them_and_export_unquantized(tmp_path, family):
    """DeepSeek-V3's and MiniMax-M2's block-scaled FP8: every tile whole (8 × 8 here), the import is bit
    for bit what ``from_pretrained`` dequantizes to in fp32, routing bias included; one step trains,
    and the export is a plain checkpoint transformers loads."""
    from transformers import FineGrainedFP8Config

    src = tmp_path / "src"
    _fp8_checkpoint(src, 8, family)
    ref = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    )
    import_train_export(tmp_path, src, ref.state_dict(), "fp32")


def test_fp8_partial_tiles_take_the_scale_of_the_tile_they_are_in(tmp_path):
    """16 × 16 tiles over 24-row and 24-column weights (q_a_proj, q_b_proj, kv_a_proj_with_mqa): the last
    tile is partial, as DeepSeek-V3's 576-row kv_a_proj_with_mqa, and scaled by its own scale
    (transformers' tile rule in ``_dequantize_fp8_weight``; its loader would spread the rows evenly)."""
    from safetensors import safe_open
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from fuyou.models.hf_io import CheckpointReader

    src = tmp_path / "src"
    _fp8_checkpoint(src, 16)
    reader = CheckpointReader(str(src), "deepseek_v3")
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        partial = [
            k for k in f.keys() if k.endswith("_scale_inv") and any(n % 16 for n in f.get_slice(k[:-10]).get_shape())
        ]
        assert len(partial) == 9  # three per layer
        for scales in partial:
            key = scales.removesuffix("_scale_inv")
            expect = _dequantize_fp8_weight(f.get_tensor(key), f.get_tensor(scales), [16, 16], torch.float32)
            assert torch.equal(reader.get(key), expect), key


@pytest.mark.slow
def test_fp8_weights_without_a_block_size_are_refused_in_one_line(tmp_path):
    import json

    from fuyou.models.hf_io import CheckpointReader, ModelFileError

    src = tmp_path / "src"
    _fp8_checkpoint(src, 8)
    conf = json.loads((src / "config.json").read_text())
    del conf["quantization_config"]["weight_block_size"]
    (src / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ModelFileError, match="no quantization_config.weight_block_size; add it"):
        CheckpointReader(str(src), "deepseek_v3")


def test_a_routing_bias_transformers_keeps_in_fp32_routes_in_fp32_in_a_bf16_run(tmp_path):
    """DeepSeek-V3's router bias steers which experts a token goes to, and ``transformers`` keeps it in
    fp32 in a bf16 model (``_keep_in_fp32_modules_strict``). Here the router's weight is zero (every
    score 0.5) and the bias alone decides: 1.003 against 1.0, a gap bf16 rounds away (its spacing at 1
    is 2⁻⁷). Fuyou's bf16 run binds the bias exactly, routes each token where the HF model loaded in
    bf16 routes it, and a bf16 export writes the bias in fp32, unrounded."""
    from safetensors.torch import load_file

    _, model = tiny("deepseek_v3")
    gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        gate.weight.zero_()
        gate.e_score_correction_bias.copy_(torch.tensor([1.0, 1.0, 1.003, 1.003]))
    bias = gate.e_score_correction_bias.clone()
    assert torch.equal(bias.to(torch.bfloat16).float(), torch.ones(4))  # what bf16 would make of it
    src = tmp_path / "src"
    model.save_pretrained(src)
    ids, labels = batches(1)[0]

    def routed(m) -> list:
        seen: list = []
        hook = m.model.layers[1].mlp.gate.register_forward_hook(
            lambda mod, _a, out: seen.append((mod.e_score_correction_bias.clone(), out[2].sort(-1).values))
        )
        return seen, hook

    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    want, hook = routed(ref)
    with torch.no_grad():
        ref(input_ids=ids)
    hook.remove()
    assert ref.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert (want[0][1] == torch.tensor([2, 3])).all()  # the higher bias wins every token

    (tmp_path / "ssd").mkdir()
    ec = EngineConfig(ssd_dirs=(str(tmp_path / "ssd"),), precision="bf16", lr=LR, cpu_memory="256MiB")
    with Engine.from_pretrained(str(src), ec) as eng:
        got, hook = routed(eng.adapter.model)
        eng.train_step(ids, labels)
        hook.remove()
        eng.export(str(tmp_path / "out"), dtype="bf16")
    held, idx = got[0]
    assert held.dtype == torch.float32 and torch.equal(held, bias)
    assert torch.equal(idx, want[0][1])
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    with Engine.resume(ec) as eng:  # a resumed run holds the stored bias
        assert torch.equal(eng.adapter.held[key], bias)
        assert eng.train_step(ids, labels).applied
    out = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert out[key].dtype == torch.float32 and torch.equal(out[key], bias)
    assert out["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # the rest as asked


@pytest.mark.parametrize(
    "family", [f if f == "hy_v3" else pytest.param(f, marks=pytest.mark.slow) for f in STANDARD_MOE]
)
def test_standard_mixtures_of_experts_import_their_published_layout_and_export_what_transformers_loads(
    tmp_path, family
):
    """Each mixture of experts the generic adapter runs, saved by transformers in its on-disk layout
    (per-expert tensors, the family's own module names: Hy3's ``mlp.router.gate``, renamed by escaped
    regular expressions in transformers' conversion mapping), imports to the model's tensors exactly,
    trains a step and exports a checkpoint its ``…ForCausalLM`` loads to the trained weights."""
    cfg, model = tiny_standard_moe(family, layers=3)
    model.save_pretrained(tmp_path / "src")
    (tmp_path / "ssd").mkdir()
    ec = EngineConfig(ssd_dirs=(str(tmp_path / "ssd"),), precision="fp32", cpu_memory="256MiB")
    with Engine.from_pretrained(str(tmp_path / "src"), ec) as eng:
        own = model.state_dict()
        assert all(torch.equal(w, own[k]) for k, w in eng.master_weights())
        assert eng.train_step(*batches(1)[0]).applied
        trained = dict(eng.master_weights())
        eng.export(str(tmp_path / "out"), dtype="fp32")
    back = type(model).from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(back[k], w) for k, w in trained.items())
