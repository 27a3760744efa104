"""The end-of-run table states the SSD bytes per parameter per step and the optimizer-state format."""

from __future__ import annotations

from fuyou.run.report import summary_table


def summary(**kw: object) -> dict:
    base = {
        "steps": 10, "tokens": 1000, "wall_s": 20.0, "tokens_per_s": 50.0, "first_loss": 3.0, "last_loss": 2.0,
        "peak_rss_bytes": 1 << 30, "cpu_memory_bytes": 2 << 30, "device_budget_bytes": 2**62,
        "ssd_read_bytes": 14 * 10 * 1000, "ssd_write_bytes": 12 * 10 * 1000, "resumed_from_step": 0,
        "optimizer_state": "split", "stored_params": 1000,
    }  # fmt: skip
    return base | kw


def test_bytes_per_parameter_per_step_and_the_format(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("COLUMNS", "300")  # one line per row
    summary_table(summary())
    out = " ".join(capsys.readouterr().out.split())
    assert "(14.0 + 12.0 B per parameter per step, optimizer state split)" in out


def test_a_resumed_run_divides_by_its_own_steps_and_an_old_summary_says_nothing(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("COLUMNS", "300")
    summary_table(summary(resumed_from_step=5, ssd_read_bytes=14 * 5 * 1000, ssd_write_bytes=12 * 5 * 1000))
    assert "(14.0 + 12.0 B per parameter per step" in " ".join(capsys.readouterr().out.split())
    old = summary()
    del old["stored_params"]
    summary_table(old)
    assert "per parameter per step" not in capsys.readouterr().out


def test_the_planners_bytes_beside_the_measured_and_bytes_outside_the_steps(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("COLUMNS", "300")
    plan = {"predicted_ssd_read_bytes": 13 * 1000, "predicted_ssd_write_bytes": 12 * 1000}
    summary_table(summary(plan=plan, ssd_outside_read_bytes=5 << 20, ssd_outside_write_bytes=0))
    out = " ".join(capsys.readouterr().out.split())
    assert "(14.0 + 12.0 B per parameter per step; planner 13.0 + 12.0, optimizer state split)" in out
    assert "SSD read / written outside the steps │ 5.0 MiB / 0 B" in out
