"""A mixture of experts' balance loss (``--moe-balance``), against ``transformers``' own computation.

``micro`` with one micro-batch is the HF model's own loss (``output_router_logits``). ``global`` over
K micro-batches is ``load_balancing_loss_func`` of the whole batch's router logits at once, and
``micro`` the mean of each micro-batch's. Every activation policy and clipping train as plain
PyTorch + AdamW on that loss (fp32); two ranks train what one process trains.
"""

from __future__ import annotations

import pytest
import torch

from fuyou.engine import Engine, EngineConfig, Plan
from tests.integration.test_engine_fidelity import LR, WD, assert_same
from tests.integration.tiny_models import batches, reference_steps, tiny

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]


def run(cfg, model, tmp_path, data, *, mode, K, policy="keep", clip=0.0):
    tmp_path.mkdir(exist_ok=True)
    nblocks = cfg.num_hidden_layers + 2
    plan = Plan(grad_accum=K, activation_policy=("keep",) + (policy,) * (nblocks - 2) + ("keep",))
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),), precision="fp32", lr=LR, weight_decay=WD, cpu_memory="256MiB",
        max_grad_norm=clip, plan=plan, moe_balance=mode,
    )  # fmt: skip
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        results = [eng.train_step(ids, labels) for ids, labels in data]
        weights = dict(eng.master_weights())
    assert all(r.applied for r in results)
    return [r.loss for r in results], [r.moe_balance_loss for r in results], weights


@pytest.mark.parametrize("family", MOE)
def test_micro_with_one_micro_batch_is_the_hf_models_own_loss(tmp_path, family):
    cfg, model = tiny(family)
    ids, labels = batches(1)[0]
    n_items = int((labels[:, 1:] != -100).sum())
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, num_items_in_batch=n_items, output_router_logits=True)
    losses, auxes, _ = run(cfg, model, tmp_path, [(ids, labels)], mode="micro", K=1)
    assert losses[0] == pytest.approx(out.loss.item(), rel=1e-6)
    assert auxes[0] == pytest.approx(out.aux_loss.item(), rel=1e-6)


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("mode", ["global", "micro"])
def test_balance_modes_train_as_the_reference(tmp_path, family, mode):
    """Two micro-batches: ``global`` counts the experts' choices over both, ``micro`` over each."""
    cfg, model = tiny(family)
    data = batches(3)
    losses, auxes, weights = run(cfg, model, tmp_path, data, mode=mode, K=2)
    ref_aux, ill = [], {}
    ref = reference_steps(model, data, 2, LR, WD, balance=mode, auxes=ref_aux, ill=ill)
    assert auxes == pytest.approx(ref_aux, rel=1e-5)
    assert_same(model, ref, losses, weights, ill=ill)


@pytest.mark.parametrize(
    "policy, clip",
    [("swap_cpu", 0.0), ("recompute", 1.0), pytest.param("swap_ssd", 1.0, marks=pytest.mark.slow),
     pytest.param("recompute_cpu", 0.0, marks=pytest.mark.slow)],
)  # fmt: skip
def test_global_balance_under_every_activation_policy(tmp_path, policy, clip):
    """The routers' probability sums stay in the graph (swapped with it) or are recomputed in backward."""
    cfg, model = tiny("mixtral", layers=3)
    data = batches(3)
    losses, _, weights = run(cfg, model, tmp_path, data, mode="global", K=2, policy=policy, clip=clip)
    ill = {}
    ref = reference_steps(model, data, 2, LR, WD, clip=clip, balance="global", ill=ill)
    assert_same(model, ref, losses, weights, ill=ill)


def test_the_modes_differ_and_off_trains_without_the_loss(tmp_path):
    """Over two micro-batches the global and micro losses are different numbers (the tests above can
    tell them apart); ``off`` trains the cross-entropy alone, and a dense model has no balance loss."""
    cfg, model = tiny("qwen3_moe")
    data = batches(1)
    g, gaux, _ = run(cfg, model, tmp_path / "g", data, mode="global", K=2)
    m, maux, _ = run(cfg, model, tmp_path / "m", data, mode="micro", K=2)
    o, oaux, _ = run(cfg, model, tmp_path / "o", data, mode="off", K=2)
    assert abs(gaux[0] - maux[0]) > 1e-4 and oaux == [None]  # 4.7e-4 here; their rounding is 1e-7
    assert o[0] == pytest.approx(reference_steps(model, data, 2, LR, WD)[0], rel=1e-6)
    assert g[0] == pytest.approx(o[0] + cfg.router_aux_loss_coef * gaux[0], rel=1e-6)
    dense_cfg, dense = tiny("llama")
    _, daux, _ = run(dense_cfg, dense, tmp_path / "d", data, mode="global", K=2)
    assert daux == [None]


@pytest.mark.slow  # ~15 s each: two launches of local ranks
@pytest.mark.parametrize("mode, cpu_async", [("global", None), ("micro", None), ("global", "arena")])
def test_two_ranks_count_the_experts_of_the_whole_step(tmp_path, mode, cpu_async):
    """``global`` sums the counts over every rank's micro-batches (one all-reduce at the turnaround,
    ordered between streams: checked on the asynchronous CPU backend too); ``micro`` averages every
    rank's micro-batch losses. Either way two ranks train one process's model."""
    from tests.integration.test_data_parallel import assert_equivalent, launch

    spec = dict(steps=2, batch=4, K=1, world=2, clip=1.0, family="mixtral", moe_balance=mode)
    (one,) = launch(spec, 1, tmp_path / "one")
    many = launch(spec, 2, tmp_path / "many", {"FUYOU_CPU_ASYNC": cpu_async} if cpu_async else None)
    assert_equivalent(one, many[0])


@pytest.mark.slow  # ~10 s: two CLI runs (the default tier keeps the engine-level balance tests)
def test_fuyou_finetune_of_a_mixture_of_experts_reports_its_balance_loss(tmp_path):
    """The CLI with its defaults (planner, clipping, ``--moe-balance global``) trains a Mixtral
    directory and writes the balance loss per step; ``--moe-balance off`` trains without it."""
    import json
    import shutil

    from click.testing import CliRunner
    from transformers import AutoTokenizer

    from cli.main import main
    from tests.integration.tiny_models import cli_inputs

    dense, data = cli_inputs(tmp_path)
    tok = AutoTokenizer.from_pretrained(dense)
    cfg, _ = tiny("mixtral")
    cfg.vocab_size = len(tok)
    torch.manual_seed(0)
    model = type(tiny("mixtral")[1])(cfg)
    moe = tmp_path / "mixtral"
    model.save_pretrained(moe)
    tok.save_pretrained(moe)
    for mode in ("global", "off"):
        out = tmp_path / mode
        args = [str(moe), "--data", data, "--output", str(out), "--steps", "2", "--seq-len", "32", "--no-progress"]
        r = CliRunner().invoke(main, ["finetune", *args, *(["--moe-balance", mode] if mode == "off" else [])])
        assert r.exit_code == 0, r.output
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(lines) == 2 and all(x["applied"] for x in lines)
        if mode == "global":
            assert all(1.0 <= x["moe_balance_loss"] <= cfg.num_local_experts for x in lines)  # top-k (2) when even
        else:
            assert all("moe_balance_loss" not in x for x in lines)
        shutil.rmtree(out)
