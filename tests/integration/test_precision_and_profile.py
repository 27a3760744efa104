"""``--precision auto`` (measured once per machine) and the quick profile measured once and reused."""

import json
import os
import time

import pytest
from click.testing import CliRunner

from fuyou.cli.main import main
from fuyou.device import get_backend
from fuyou.device.precision import AUTO_ENV, SLOW_FACTOR, bf16_slowdown, choose_precision, measure_bf16_slowdown
from fuyou.errors import ConfigError, FuyouWarning
from fuyou.machine import cache_get, cache_put, machine_key
from fuyou.run.demo import _random_model

TEXT = [{"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # some python {i}"} for i in range(40)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _random_model(str(tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, empty per-machine cache for this test, and ``auto`` measured (not forced by ``--auto-precision``)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("FUYOU_CACHE", str(d))
    monkeypatch.delenv(AUTO_ENV, raising=False)
    return d


def test_auto_precision_can_be_forced_either_way(monkeypatch):
    """``$FUYOU_AUTO_PRECISION`` (the suite's ``--auto-precision``) decides ``auto`` without measuring, so the
    tests run as either kind of CPU would; an explicit precision is never changed by it."""
    backend = get_backend("cpu")
    for forced in ("bf16", "fp32"):
        monkeypatch.setenv(AUTO_ENV, forced)
        choice = choose_precision("auto", backend)
        assert (choice.precision, choice.bf16_slowdown) == (forced, None) and AUTO_ENV in choice.reason
        assert choose_precision("fp32", backend).precision == "fp32"
    monkeypatch.setenv(AUTO_ENV, "fp16")
    with pytest.raises(ConfigError, match=f"{AUTO_ENV} must be bf16 or fp32"):
        choose_precision("auto", backend)


def _plant(factor: float) -> None:
    """Record ``factor`` as this machine's measured bf16 slowdown (what a first measurement stores)."""
    backend = get_backend("cpu")
    cache_put("bf16-speed", machine_key(backend.name + ":" + backend.describe()), factor)


def test_probe_measures_once_per_machine_and_decides_by_the_factor(cache):
    backend = get_backend("cpu")
    t0 = time.perf_counter()
    factor, hit = bf16_slowdown(backend)
    assert not hit and factor > 0 and time.perf_counter() - t0 < 30
    again, hit = bf16_slowdown(backend)
    assert hit and again == factor
    choice = choose_precision("auto", backend)
    assert choice.precision == ("fp32" if factor > SLOW_FACTOR else "bf16") and choice.bf16_slowdown == factor
    assert choose_precision("fp32", backend).bf16_slowdown is None  # nothing measured when fp32 is asked for
    assert choose_precision("bf16", backend).precision == "bf16"
    with pytest.raises(ConfigError, match="--precision must be one of auto, bf16, fp32"):
        choose_precision("fp16", backend)
    # a new ISA restriction is a new machine: measured again, under its own key
    os.environ["ATEN_CPU_CAPABILITY"] = "default"
    try:
        assert bf16_slowdown(backend)[1] is False
    finally:
        del os.environ["ATEN_CPU_CAPABILITY"]


def test_probe_is_a_real_ratio_of_two_timings():
    assert 0 < measure_bf16_slowdown(get_backend("cpu")) < 1e4


def run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _finetune(model_dir, data, out, *extra):
    return run(
        [
            "finetune",
            model_dir,
            "--data",
            data,
            "--output",
            str(out),
            "--steps",
            "1",
            "--seq-len",
            "32",
            "--micro-batch-size",
            "2",
            "--cpu-memory",
            "256MiB",
            "--no-progress",
            *extra,
        ]
    )


def _data(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in TEXT) + "\n")
    return str(p)


def _assert_auto_precision(out, output: str, factor: float, expect: str) -> None:
    """The decision is printed and recorded in run.json; the model is saved in its checkpoint's own dtype
    (fp32 here), whatever it computed in, as Trainer saves a model trained with bf16 autocast."""
    assert f"precision: {expect} (auto: bf16 matmul measured {factor:.1f}×" in output
    rec = json.loads((out / "run.json").read_text())["precision"]
    assert rec == {"precision": expect, "requested": "auto", "bf16_slowdown": factor, "reason": rec["reason"]}
    saved = json.loads((out / "model" / "config.json").read_text())
    assert saved.get("dtype", saved.get("torch_dtype")) == "float32"


def test_auto_precision_picks_bf16_where_it_is_fast(tmp_path, cache, model_dir):
    _plant(1.0)
    r = _finetune(model_dir, _data(tmp_path), tmp_path / "run")
    assert r.exit_code == 0, r.output
    _assert_auto_precision(tmp_path / "run", r.output, 1.0, "bf16")


def test_explicit_bf16_on_a_slow_bf16_machine_warns_with_the_factor(tmp_path, cache, model_dir):
    _plant(40.0)
    with pytest.warns(FuyouWarning, match=r"bf16 matmul measured 40\.0× the time of fp32"):
        r = _finetune(model_dir, _data(tmp_path), tmp_path / "run", "--precision", "bf16")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "run" / "run.json").read_text())["precision"]["precision"] == "bf16"


def test_quick_profile_is_measured_once_and_reused(tmp_path, cache, model_dir, monkeypatch):
    """No profile anywhere: the first run measures the quick profile; a re-run, a resumed run and a
    second run on this machine reuse it (nothing measured again), and each saves it to its run."""
    import fuyou.run.plan_choice as fp

    monkeypatch.setattr(fp, "default_profile", lambda: str(tmp_path / "no-profile-here.json"))
    monkeypatch.delenv("FUYOU_PROFILE", raising=False)
    _plant(40.0)
    data = _data(tmp_path)
    first = _finetune(model_dir, data, tmp_path / "a", "--save-every", "1", "--steps", "2")
    assert first.exit_code == 0, first.output
    assert "measuring a quick hardware profile" in first.output
    _assert_auto_precision(tmp_path / "a", first.output, 40.0, "fp32")  # where bf16 is slow: fp32
    keys = set(json.loads((cache / "quick-profile.json").read_text()))
    assert len(keys) == 2  # the machine's figures and the model's
    again = _finetune(model_dir, data, tmp_path / "b")
    resumed = _finetune(model_dir, data, tmp_path / "a", "--resume", "auto", "--steps", "3")
    for r in (again, resumed):
        assert r.exit_code == 0, r.output
        assert "measuring" not in r.output
    assert set(json.loads((cache / "quick-profile.json").read_text())) == keys
    p_a = json.loads((tmp_path / "a" / "profile.json").read_text())
    p_b = json.loads((tmp_path / "b" / "profile.json").read_text())
    assert p_a == p_b and p_a["compute_bytes"] == 4  # measured in the run's precision (fp32 here)
    assert cache_get("quick-profile", sorted(keys)[0]) is not None


def test_a_cached_profile_the_run_disproves_is_dropped_and_measured_again(tmp_path, cache, model_dir, monkeypatch):
    """A quick profile cached while the machine was busy (here: its compute rates planted 20× too slow)
    predicts a step far from the one the run measures: the run measures it again, says so (a warning,
    ``profile_check`` in run.json) and the new figures replace the cached ones, which the next run
    reuses."""
    import fuyou.run.plan_choice as fp

    monkeypatch.setattr(fp, "default_profile", lambda: str(tmp_path / "no-profile-here.json"))
    monkeypatch.delenv("FUYOU_PROFILE", raising=False)
    data = _data(tmp_path)
    assert _finetune(model_dir, data, tmp_path / "a", "--precision", "fp32").exit_code == 0  # measured, cached
    doc = json.loads((cache / "quick-profile.json").read_text())
    for entry in doc.values():
        for point in entry.get("compute", []) + entry.get("head_compute", []):
            point["fwd_flops_per_s"] /= 20
            point["bwd_flops_per_s"] /= 20
    (cache / "quick-profile.json").write_text(json.dumps(doc))
    with pytest.warns(FuyouWarning, match="the cached ones were stale"):
        busy = _finetune(model_dir, data, tmp_path / "b", "--precision", "fp32", "--steps", "4")
    assert busy.exit_code == 0 and "measuring a quick" not in busy.output, busy.output
    check = json.loads((tmp_path / "b" / "run.json").read_text())["profile_check"]
    assert check["verdict"] == "re-measured" and check["predicted_over_measured"] > fp.PROFILE_TOLERANCE
    assert check["remeasured_step_s"] < check["predicted_step_s"] / fp.PROFILE_TOLERANCE
    fresh = json.loads((cache / "quick-profile.json").read_text())
    assert fresh.keys() == doc.keys() and fresh != doc
    again = _finetune(model_dir, data, tmp_path / "c", "--precision", "fp32", "--steps", "4")
    assert again.exit_code == 0 and "measuring a quick" not in again.output  # the new figures, from the cache
    # (its own check may measure again: a 2-layer model's millisecond steps are mostly noise to the cost model)


def test_a_lora_run_times_its_blocks_as_lora_computes_them(tmp_path, cache, model_dir, monkeypatch):
    """LoRA's backward is not half a trained block's (the adapters' matmuls and casts, every element-wise
    op's backward remain): its quick profile times the blocks with the run's adapters on the frozen base,
    cached apart from full fine-tuning's, and its backward rate is the frozen backward's own."""
    import fuyou.run.plan_choice as fp

    monkeypatch.setattr(fp, "default_profile", lambda: str(tmp_path / "no-profile-here.json"))
    monkeypatch.delenv("FUYOU_PROFILE", raising=False)
    data = _data(tmp_path)
    assert _finetune(model_dir, data, tmp_path / "full", "--precision", "fp32").exit_code == 0
    r = _finetune(model_dir, data, tmp_path / "lora", "--precision", "fp32", "--lora-rank", "4")
    assert r.exit_code == 0 and "measuring a quick hardware profile" in r.output, r.output
    doc = json.loads((cache / "quick-profile.json").read_text())
    full_key, lora_key = sorted((k for k, v in doc.items() if "compute" in v), key=len)
    assert lora_key == full_key.replace(f"/{fp.TIMING}", f"/lora4-all-linear/{fp.TIMING}")
    full, lora = (doc[k]["compute"][0] for k in (full_key, lora_key))
    assert doc[lora_key]["lora_step_s"] > 0 and "lora_step_s" not in doc[full_key]  # the adapters' update, timed
    assert lora["bwd_flops_per_s"] < full["bwd_flops_per_s"]  # the same FLOPs counted once, not twice
