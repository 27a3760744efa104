"""``--freeze``: parameters named by globs do not train. A block frozen whole has no optimizer state
and is never written; frozen parameters in a block that trains live in its read-only extent
``f/<block>``: no optimizer state, no gradient, never rewritten, so they stay exactly as they were. Either way the run equals plain PyTorch + AdamW with those
parameters' ``requires_grad=False`` (fp32, losses and weights within 1e-5)."""

from __future__ import annotations

import copy
import fnmatch
import math

import pytest
import torch

from fuyou.engine import Engine, EngineConfig, Plan
from fuyou.errors import ConfigError
from tests.integration.test_engine_fidelity import LR, STEPS, WD, assert_same
from tests.integration.tiny_models import batches, reference_steps, tiny

LOWER = ("model.embed_tokens.*", "model.layers.0.*", "*.self_attn.q_proj.weight")


def frozen_reference(model, patterns, data, clip, balance=None):
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            p.requires_grad_(False)
    ill: dict | None = {} if balance else None
    return reference_steps(model, data, 2, LR, WD, clip=clip, balance=balance, ill=ill), ill


@pytest.mark.parametrize(
    "family, patterns, policy, clip",
    [
        ("llama", LOWER, "recompute", 0.5),  # embedding and layer 0 whole, q_proj of layer 1 alone
        ("qwen2", LOWER, "keep", 0.0),  # overlap_backward: block 0 frozen, the last gradient is another's
        ("llama_tied", ("model.embed_tokens.*",), "swap_cpu", 0.5),  # the head's tied weight frozen with it
        ("gpt2", ("transformer.h.1.*", "transformer.ln_f.*"), "recompute_cpu", 0.0),  # the head's own part frozen
        pytest.param("mixtral", ("*.experts.*", "model.embed_tokens.*"), "recompute", 0.5, marks=pytest.mark.slow),
    ],
)
def test_frozen_parameters_train_as_requires_grad_false(tmp_path, family, patterns, policy, clip):
    cfg, model = tiny(family)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = Plan(grad_accum=2, activation_policy=("keep",) + (policy,) * cfg.num_hidden_layers + ("keep",))
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),), precision="fp32", lr=LR, weight_decay=WD, cpu_memory="256MiB",
        max_grad_norm=clip, plan=plan, freeze=patterns,
    )  # fmt: skip
    data = batches(STEPS)
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        results = [eng.train_step(ids, labels) for ids, labels in data]
        weights = dict(eng.master_weights())
        frozen_blocks = {eng.layout.blocks[b].name for b in eng.layout.frozen_blocks}
        state = {e.name.split("/")[1] for e in eng.store.extents if e.name.startswith("s/")}
    assert all(r.applied for r in results)
    assert frozen_blocks and not frozen_blocks & state  # a block frozen whole has no optimizer state
    ref, ill = frozen_reference(model, patterns, data, clip, "global" if family == "mixtral" else None)
    assert_same(model, ref, [r.loss for r in results], weights, ill=ill)
    frozen = [k for k in weights if any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    assert frozen and all(torch.equal(weights[k], sd[k]) for k in frozen)  # exactly as they were


def test_frozen_blocks_are_read_not_written(tmp_path):
    """Freezing the lower half of a model removes its state and its writes from every step."""
    cfg, model = tiny("llama", layers=4)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    written = {}
    for name, freeze in (("full", ()), ("half", ("model.embed_tokens.*", "model.layers.[01].*"))):
        (tmp_path / name).mkdir()
        ec = EngineConfig(ssd_dirs=(str(tmp_path / name),), precision="fp32", cpu_memory="256MiB", freeze=freeze)
        with Engine.from_state_dict(cfg, sd, ec) as eng:
            written[name] = [eng.train_step(ids, labels).ssd_write_bytes for ids, labels in batches(3)][1:]
            names = {e.name for e in eng.store.extents}
        if freeze:
            assert not any(n.startswith(("s/embed", "s/layer.0/", "s/layer.1/")) for n in names)
    assert all(0 < h < f for h, f in zip(written["half"], written["full"])), written


PARTIAL = ("*.self_attn.q_proj.weight", "*.mlp.down_proj.weight")


def test_frozen_parameters_of_a_training_block_are_stored_apart(tmp_path):
    """q_proj and down_proj of every layer frozen: the layers' state covers the other parameters only,
    their gradients leave the device without them, the frozen part is read (RAM tier for layer 0,
    SSD for layer 1) and never rewritten; the run equals plain PyTorch and exports every weight."""
    from fuyou.engine.export import export_store
    from fuyou.models.hf_io import CheckpointReader
    from fuyou.storage.manifest import read_manifest

    cfg, model = tiny("llama", layers=2)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = Plan(grad_accum=2, ram_weight_blocks=2, activation_policy=("keep", "recompute", "swap_cpu", "keep"))
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path / "s"),), precision="fp32", lr=LR, weight_decay=WD, cpu_memory="256MiB",
        max_grad_norm=0.5, plan=plan, freeze=PARTIAL,
    )  # fmt: skip
    data = batches(STEPS)
    (tmp_path / "s").mkdir()
    frozen_files = lambda: {n: f for n, f in read_manifest(str(tmp_path / "s"))["files"].items() if n.startswith("f/")}  # noqa: E731
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        lay = eng.layout
        before = frozen_files()
        eng.timeline.clear()
        results = [eng.train_step(ids, labels) for ids, labels in data]
        eng.timeline.resolve()
        spans = list(eng.timeline.spans)
        eng.flush()
        weights = dict(eng.master_weights())
        layers = [b for b, blk in enumerate(lay.blocks) if blk.name.startswith("layer.")]
        for b in layers:
            keys = {p.key for p in lay.blocks[b].params}
            frozen = {k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in PARTIAL)}
            f = lay.f(b)
            assert f is not None and {t.name for t in f.tensors} == frozen
            assert {t.name for t in lay.w(b).tensors} == keys - frozen
            state = sum(hi - lo for lo, hi in lay.chunks(b))
            trained = sum(math.prod(t.shape) for t in lay.w(b).tensors)
            assert trained <= state < trained + 32 * len(keys)  # the trained part only (and its alignment gaps)
            assert lay.full_numel(b) == lay.numel(b) < lay.device_numel(b)
        assert eng.tier.holds(lay.f(layers[0]).name) and not eng.tier.holds(lay.f(layers[1]).name)
    assert all(r.applied for r in results)
    assert frozen_files() == before and len(before) == 2  # the same files: never rewritten
    reads = {(s.resource, s.label) for s in spans if "f/" in s.label}
    assert reads == {("ssd_read", "f/layer.1"), ("ram_copy", "ram→host f/layer.0")}, reads  # read, never written
    ref, _ = frozen_reference(model, PARTIAL, data, 0.5)
    assert_same(model, ref, [r.loss for r in results], weights)
    export_store([str(tmp_path / "s")], str(tmp_path / "hf"), "fp32")
    exported = CheckpointReader(str(tmp_path / "hf"), "llama")
    assert all(torch.equal(exported.get(k), w) for k, w in weights.items())
    assert all(torch.equal(weights[k], sd[k]) for k in weights if any(fnmatch.fnmatchcase(k, p) for p in PARTIAL))


def test_bad_freezes_are_refused_by_name(tmp_path):
    cfg, model = tiny("llama")
    sd = model.state_dict()

    def engine(**kw):
        return Engine.from_state_dict(cfg, sd, EngineConfig(ssd_dirs=(str(tmp_path),), cpu_memory="256MiB", **kw))

    with pytest.raises(ConfigError, match=r"--freeze 'model.layer.0.\*' matches no parameter"):
        engine(freeze=("model.layer.0.*",))
    with pytest.raises(ConfigError, match="nothing would train"):
        engine(freeze=("*",))
    with engine(freeze=("model.layers.0.*",)) as eng:
        eng.train_step(*batches(1)[0])
    with pytest.raises(ConfigError, match="same patterns"):
        Engine.resume(EngineConfig(ssd_dirs=(str(tmp_path),), cpu_memory="256MiB"))
    with Engine.resume(EngineConfig(ssd_dirs=(str(tmp_path),), cpu_memory="256MiB", freeze=("model.layers.0.*",))):
        pass


def test_the_trainer_freezes_what_the_model_does_not_train(tmp_path):
    """FuyouTrainer on a model whose embedding has ``requires_grad=False`` equals transformers.Trainer."""
    from tests.integration.test_hf_trainer import dataset, losses, plain_and_fuyou

    _, model = tiny("llama", layers=2)
    model.model.embed_tokens.weight.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    before = model.model.embed_tokens.weight.detach().clone()
    ref, fy = plain_and_fuyou(tmp_path, ref_model, model, dataset())
    assert losses(fy) == pytest.approx(losses(ref), rel=1e-5)
    assert sorted(fy.engine.layout.frozen_blocks) == [0]
    ref_sd = ref_model.state_dict()
    for k, v in fy.model.state_dict().items():
        assert (v - ref_sd[k]).abs().max().item() <= 1e-5 * ref_sd[k].abs().max().item() + 1e-12, k
    assert torch.equal(fy.model.model.embed_tokens.weight, before)


def test_fuyou_finetune_freezes_by_glob(tmp_path):
    """The CLI with its defaults (planner, clipping): ``--freeze`` twice trains the rest and leaves the
    frozen weights as they were in the exported model; a pattern that matches nothing fails in one line."""
    import json

    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from cli.main import main
    from tests.integration.tiny_models import cli_inputs

    model, data = cli_inputs(tmp_path)
    out = tmp_path / "out"
    args = [model, "--data", data, "--output", str(out), "--steps", "2", "--seq-len", "32", "--no-progress"]
    r = CliRunner().invoke(main, ["finetune", *args, "--freeze", "model.embed_tokens.*", "--freeze", "*.mlp.*"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(x["applied"] for x in lines)
    before = AutoModelForCausalLM.from_pretrained(model).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    tied = {"lm_head.weight"}  # this model's head is its embedding
    frozen = {k for k in after if k.startswith("model.embed_tokens.") or ".mlp." in k} | tied
    assert all(torch.equal(after[k], before[k].to(after[k].dtype)) for k in frozen)
    assert any(not torch.equal(after[k], before[k].to(after[k].dtype)) for k in set(after) - frozen)
    r = CliRunner().invoke(main, ["export", str(out), str(tmp_path / "exp"), "--dtype", "fp32"])
    assert r.exit_code == 0, r.output  # reads a frozen block's weights as its master: it has no state
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exp").state_dict()
    assert all(torch.equal(exported[k], before[k].float()) for k in frozen)
    bad = [*args[:3], "--output", str(tmp_path / "bad"), *args[5:]]
    r = CliRunner().invoke(main, ["finetune", *bad, "--freeze", "nope.*"])
    assert r.exit_code != 0 and "--freeze 'nope.*' matches no parameter" in r.output


def test_frozen_weights_leave_a_bf16_run_exactly_as_they_came(tmp_path):
    """An fp32 checkpoint computed in bf16: what never trains (a block frozen whole, frozen parameters of a
    block that trains, a LoRA base) comes out of export, resumed or not, bit-identical to the checkpoint,
    in its own dtype by default (the fp32 values kept apart in ``o/`` extents, which only export reads);
    no such copy where the compute dtype holds them already."""
    from fuyou.engine.export import export_store
    from fuyou.engine.lora import LoraSettings
    from fuyou.models.hf_io import CheckpointReader

    cfg, model = tiny("llama", layers=2)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    patterns = ("model.embed_tokens.*", "*.self_attn.q_proj.weight")

    def run(name, precision="bf16", source=sd, **kw):
        (tmp_path / name).mkdir()
        ec = EngineConfig(ssd_dirs=(str(tmp_path / name),), precision=precision, cpu_memory="256MiB", **kw)
        with Engine.from_state_dict(cfg, source, ec) as eng:
            for ids, labels in batches(2):
                eng.train_step(ids, labels)
            origin = [e.name for e in eng.store.extents if e.name.startswith("o/")]
        if name == "freeze":  # the values are the store's, kept across a resume
            with Engine.resume(ec) as eng:
                eng.train_step(*batches(1)[0])
        export_store([str(tmp_path / name)], str(tmp_path / f"{name}-hf"))
        export_store([str(tmp_path / name)], str(tmp_path / f"{name}-bf16"), "bf16")
        out = CheckpointReader(str(tmp_path / f"{name}-hf"), "llama")
        return {k: out.get(k) for k in out.where}, origin

    out, origin = run("freeze", freeze=patterns)
    frozen = [k for k in out if any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    assert frozen and all(out[k].dtype == torch.float32 and torch.equal(out[k], sd[k]) for k in frozen)
    assert origin and any(not torch.equal(out[k], sd[k]) for k in out if k not in frozen)  # the rest trained
    assert all(not torch.equal(sd[k].bfloat16().float(), sd[k]) for k in frozen)  # bf16 alone would round them
    rounded = CheckpointReader(str(tmp_path / "freeze-bf16"), "llama")
    assert all(torch.equal(rounded.get(k), sd[k].bfloat16()) for k in frozen)  # --dtype bf16: as asked
    out, origin = run("lora", lora=LoraSettings(rank=4, alpha=8))
    assert origin and all(torch.equal(out[k], sd[k]) for k in out)  # the base (adapters not merged by export_store)
    _, origin = run("fp32", "fp32", freeze=patterns)
    assert not origin  # fp32 compute holds the checkpoint exactly
    half = {k: v.bfloat16() for k, v in sd.items()}
    out, origin = run("bf16-source", source=half, freeze=patterns)
    assert not origin and all(out[k].dtype == torch.bfloat16 and torch.equal(out[k], half[k]) for k in frozen)
