"""``fuyou finetune`` / ``fuyou export`` on a tiny model: formats, YAML, export, and bad input."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from fuyou.cli.main import main
from fuyou.run.demo import _random_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _random_model(str(tmp_path_factory.mktemp("m") / "tiny"))


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


TEXT = [{"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # some python {i}"} for i in range(40)]
PC = [{"prompt": f"Question {i}: what is {i}+{i}?", "completion": f" The answer is {2 * i}."} for i in range(40)]
CHAT = [
    {"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i} {i} {i}"}]}
    for i in range(40)
]


def run(args, **kw):
    return CliRunner().invoke(main, args, catch_exceptions=False, **kw)


@pytest.mark.parametrize("records", [TEXT, PC, CHAT], ids=["text", "prompt_completion", "messages"])
def test_finetune_each_format_then_export(tmp_path, model_dir, records):
    data = write_jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "run"
    r = run(
        [
            "finetune",
            model_dir,
            "--data",
            data,
            "--output",
            str(out),
            "--steps",
            "3",
            "--seq-len",
            "32",
            "--micro-batch-size",
            "2",
            "--grad-accum",
            "2",
            "--lr",
            "1e-3",
            "--cpu-memory",
            "256MiB",
            "--no-progress",
            "--trace",
            str(tmp_path / "t.json"),
        ]
    )
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "run.json").read_text())
    assert summary["steps"] == 3 and summary["eval_loss_before"] is not None
    assert summary["optimizer_state"] == "split"  # --optimizer-state auto, a new store
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens",
        "tokens_per_s",
        "tflops",
        "flop_formula",
        "busy_frac",
        "ssd_read_gb",
        "ssd_write_gb",
        "bottleneck",
    ):
        assert key in lines[0], key
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert model.generate(**tok("def f", return_tensors="pt"), max_new_tokens=3, do_sample=False).shape[1] >= 3
    r = run(["export", str(out), str(tmp_path / "exported"), "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    for k, v in model.state_dict().items():
        assert (v.float() - again.state_dict()[k]).abs().max() <= 1e-2 * v.float().abs().max() + 1e-6, k


def test_yaml_config_and_flag_override(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", TEXT)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data: {data}\nseq-len: 32\nsteps: 4\nlr: 0.5\ncpu_memory: 256MiB\nbetas: [0.8, 0.95]\n")
    out = tmp_path / "run"
    r = run(
        [
            "finetune",
            model_dir,
            "--config",
            str(cfg),
            "--output",
            str(out),
            "--steps",
            "2",
            "--lr",
            "1e-4",
            "--no-progress",
            "--lr-schedule",
            "constant",
        ]
    )
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["lr"] == pytest.approx(1e-4)  # flags override the file


def cli_error(args):
    """Run the real console script: one line on stderr, exit 1, no traceback."""
    r = subprocess.run(
        [sys.executable, "-m", "fuyou.cli.main", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    # the one progress line a first run may print (the session's quick profile is measured once) is not the error
    return "\n".join(x for x in r.stderr.strip().splitlines() if not x.startswith("planner: measuring"))


def cli_error_here(args):
    """``cli_error`` in this process (no interpreter start-up): exit 1 through the CLI's error handler, no other
    exception, the message on stderr."""
    r = CliRunner().invoke(main, args)
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    return "\n".join(x for x in r.stderr.strip().splitlines() if not x.startswith("planner: measuring"))


def test_bad_inputs_give_one_line_errors(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", TEXT)
    out = tmp_path / "run"
    common = ["--output", str(out), "--steps", "1", "--seq-len", "32", "--cpu-memory", "256MiB", "--no-progress"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [TEXT[0], '{"text": "unterminated'])
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in os.listdir(model_dir):
        if not f.endswith(".safetensors"):
            with open(os.path.join(model_dir, f), "rb") as src, open(corrupt / f, "wb") as dst:
                dst.write(src.read())
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    small = tmp_path / "small-vocab"  # the model's embedding has fewer rows than its directory's tokenizer has tokens
    shutil.copytree(model_dir, small)
    conf = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(conf | {"vocab_size": 96}))
    int4 = tmp_path / "int4"  # quantized as Kimi K2.5 is published: a method the import does not undo
    shutil.copytree(model_dir, int4)
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (int4 / "config.json").write_text(json.dumps(conf | {"quantization_config": quant}))
    cases = [
        ([str(tmp_path / "nope"), "--data", data], "no config.json"),
        ([str(bert), "--data", data], "unsupported architecture"),
        ([str(corrupt), "--data", data], "missing or corrupt"),
        ([model_dir, "--data", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        ([model_dir, "--data", bad], "bad.jsonl:2"),
        ([model_dir, "--data", empty], "empty.jsonl"),
        ([model_dir, "--data", data, "--seq-len", "999999"], "--seq-len"),
        ([model_dir, "--data", data, "--cpu-memory", "1MiB"], "--cpu-memory"),
        ([model_dir, "--data", data, "--gpu-memory", "64KiB"], "--gpu-memory"),  # the planner refuses
        # the budget rules (no planner) hold the largest block, not the step: the engine's device model refuses
        # the step's shape before it creates a store
        ([model_dir, "--data", data, "--plan", "rules", "--precision", "fp32", "--gpu-memory", "7MB"], "a step of"),
        ([model_dir, "--data", data, "--cpu-memory", "lots"], "--cpu-memory"),
        ([model_dir, "--data", data, "--ssd", str(tmp_path / "no-such-ssd")], "does not exist"),
        ([model_dir, "--data", data, "--ssd", os.path.join(data, "x")], "is a file, not a directory"),
        ([model_dir, "--data", data, "--steps", "0"], "--steps"),
        ([str(small), "--data", data], "the tokenizer files are another model's"),
        ([str(int4), "--data", data], "quantized with 'compressed-tensors'"),
    ]
    for i, (args, match) in enumerate(cases):  # the console script for two, the rest in this process (faster)
        msg = (cli_error if i < 2 else cli_error_here)(["finetune", *common, *args])
        assert match in msg, (args, msg)
        assert len(msg.splitlines()) == 1 or msg.startswith("Usage"), msg
        assert not (out / "run.json").exists() and not (out / "model").exists()
        assert not out.exists(), (args, list(out.rglob("*")))  # a refused run leaves nothing behind
    if os.geteuid() != 0:
        os.chmod(tmp_path, 0o500)
        assert "not writable" in cli_error(["finetune", model_dir, "--data", data, "--output", str(tmp_path / "x")])
        os.chmod(tmp_path, 0o700)


def test_unwritable_output_and_ssd(tmp_path, model_dir, readonly_dir):
    data = write_jsonl(tmp_path / "d.jsonl", TEXT)
    common = ["--steps", "1", "--seq-len", "32", "--cpu-memory", "256MiB", "--no-progress", "--data", data]
    msg = cli_error(["finetune", model_dir, "--output", os.path.join(readonly_dir, "run"), *common])
    assert "not writable" in msg and "--output" in msg
    msg = cli_error(["finetune", model_dir, "--output", str(tmp_path / "run"), "--ssd", readonly_dir, *common])
    assert "not writable" in msg and readonly_dir in msg
    assert not (tmp_path / "run" / "run.json").exists()
    (tmp_path / "afile").write_text("kept")
    msg = cli_error(["finetune", model_dir, "--output", str(tmp_path / "afile"), *common])
    assert msg == f"error: --output {tmp_path / 'afile'} is a file, not a directory; pass a directory (new or a run's)"
    assert (tmp_path / "afile").read_text() == "kept"


def test_finetune_plans_with_the_cost_model_by_default(tmp_path, model_dir, monkeypatch):
    """No profile anywhere: a quick one is measured into the run directory and the planner's plan runs."""
    import fuyou.run.plan_choice as fp

    monkeypatch.setattr(fp, "default_profile", lambda: str(tmp_path / "no-profile-here.json"))
    monkeypatch.delenv("FUYOU_PROFILE", raising=False)
    data = write_jsonl(tmp_path / "d.jsonl", TEXT)
    out = tmp_path / "run"
    r = run(
        [
            "finetune",
            model_dir,
            "--data",
            data,
            "--output",
            str(out),
            "--steps",
            "2",
            "--seq-len",
            "32",
            "--micro-batch-size",
            "2",
            "--grad-accum",
            "2",
            "--cpu-memory",
            "256MiB",
            "--no-progress",
        ]
    )
    assert r.exit_code == 0, r.output
    plan = json.loads((out / "run.json").read_text())["plan"]
    assert plan["source"] == "planner" and plan["profile"] == str(out / "profile.json")
    assert json.loads((out / "profile.json").read_text())["device"] == "cpu"
    assert plan["predicted_step_s"] > 0 and plan["predicted_bottleneck"]
    ran = plan["executed"]
    assert ran["grad_accum"] == 2 and ran["prefetch_depth"] == plan["plan"]["prefetch_depth"]
    assert ran["activation_policy"] == plan["plan"]["activation_policy"]
    assert plan["state_chunk_executed"] == plan["state_chunk"]
    assert ran["schedule"] == "overlap_next_forward"  # clipping is on by default

    # the cached profile is reused, and flags override single choices
    out2 = tmp_path / "run2"
    r = run(
        [
            "finetune",
            model_dir,
            "--data",
            data,
            "--output",
            str(out2),
            "--steps",
            "1",
            "--seq-len",
            "32",
            "--cpu-memory",
            "256MiB",
            "--no-progress",
            "--profile",
            str(out / "profile.json"),
            "--prefetch-depth",
            "1",
            "--activations",
            "swap_cpu",
        ]
    )
    assert r.exit_code == 0, r.output
    plan = json.loads((out2 / "run.json").read_text())["plan"]
    assert plan["profile"] == str(out / "profile.json") and not (out2 / "profile.json").exists()
    assert plan["executed"]["prefetch_depth"] == 1
    assert set(plan["executed"]["activation_policy"][1:-1]) == {"swap_cpu"}


def test_finetune_rules_plan_and_bad_profile(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", TEXT)
    out = tmp_path / "run"
    r = run(
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
            "--cpu-memory",
            "256MiB",
            "--no-progress",
            "--plan",
            "rules",
            "--activations",
            "keep",
        ]
    )
    assert r.exit_code == 0, r.output
    plan = json.loads((out / "run.json").read_text())["plan"]
    assert plan["source"] == "rules" and set(plan["executed"]["activation_policy"][1:-1]) == {"keep"}
    msg = cli_error(
        [
            "finetune",
            model_dir,
            "--data",
            data,
            "--output",
            str(tmp_path / "x"),
            "--steps",
            "1",
            "--seq-len",
            "32",
            "--no-progress",
            "--profile",
            str(tmp_path / "missing.json"),
        ]
    )
    assert "no hardware profile" in msg and len(msg.splitlines()) == 1


def test_two_identical_runs_report_the_same_bytes_per_step_and_the_planners(tmp_path, model_dir):
    """The CLI's defaults (planner, clipping, precision auto) with the state on the store: two identical runs
    write the same SSD bytes per step in metrics.jsonl and in total, and every step after the first reads and
    writes exactly the planner's bytes per step (the first also reads what later steps are handed from the
    last update); what moves outside the steps (evaluations) is reported apart. The second run plans from
    the first's profile (``OUTPUT/profile.json``): the first may measure the quick profile again at its end
    (its steps disagreeing with figures cached on a busy machine), and another profile may plan another run."""
    data = write_jsonl(tmp_path / "d.jsonl", TEXT)
    got = []
    for name, same in (("a", []), ("b", ["--profile", str(tmp_path / "a" / "profile.json")])):
        out = tmp_path / name
        args = ["finetune", model_dir, "--data", data, "--output", str(out), "--steps", "4", "--seq-len", "32"]
        r = run([*args, "--micro-batch-size", "2", "--cpu-memory", "32MiB", "--no-progress", *same])
        assert r.exit_code == 0, r.output
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((out / "run.json").read_text())
        per_step = [(round(x["ssd_read_gb"] * 1e9), round(x["ssd_write_gb"] * 1e9)) for x in lines]
        got.append((per_step, summary["ssd_read_bytes"], summary["ssd_write_bytes"]))
        plan = summary["plan"]
        assert per_step[1:] == [(plan["predicted_ssd_read_bytes"], plan["predicted_ssd_write_bytes"])] * 3
        assert per_step[0][0] > per_step[1][0] and per_step[0][1] == per_step[1][1]
        assert summary["ssd_outside_read_bytes"] > 0  # the evaluations before and after
        assert sum(r for r, _ in per_step) == summary["ssd_read_bytes"]
        n = summary["stored_params"]
        assert lines[-1]["ssd_write_B_per_param"] == plan["predicted_ssd_write_bytes"] / n
    assert got[0] == got[1]
