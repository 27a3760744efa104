import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from fuyou.cli.main import main


def test_help_is_instant_and_does_not_import_torch():
    code = "import sys, fuyou.cli.main as m; assert 'torch' not in sys.modules, 'torch imported'"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    assert time.perf_counter() - t0 < 5
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "doctor" in r.output


def test_doctor_ok_and_failing_dir(tmp_path):
    r = CliRunner().invoke(main, ["doctor", "--ssd", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "O_DIRECT" in r.output and "memlock" in r.output and "numba layer" in r.output
    r = CliRunner().invoke(main, ["doctor", "--ssd", str(tmp_path / "missing")])
    assert r.exit_code == 1 and "does not exist" in r.output


@pytest.mark.parametrize("layer,status", [("tbb", "ok"), ("omp", "warn"), ("workqueue", "warn")])
def test_doctor_names_numbas_threading_layer_and_the_fix(monkeypatch, layer, status):
    from fuyou.optim import parallel
    from fuyou.run.doctor import check_threading_layer

    monkeypatch.setattr(parallel, "threading_layer", lambda: layer)
    c = check_threading_layer()
    assert c.status == status and c.detail.startswith(layer), c
    assert status == "ok" or "pip install tbb" in c.detail


def test_console_script_installed():
    r = subprocess.run(["fuyou", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and "fuyou" in r.stdout
