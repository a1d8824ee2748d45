"""Rank 0's metrics sinks: metrics.jsonl, the console line, the reward curve and `megarl plot`, W&B offline (read
back with wandb's own record schema) and disabled, and the silent tracker of other ranks."""

import json
import os

import pytest

from megarl.cli import main as megarl_main
from megarl.config.schema import LoggingConfig, WandbConfig
from megarl.logging import Tracker, read_metrics
from tests.wandb_reader import history, records

PNG = b"\x89PNG\r\n\x1a\n"
ROWS = [{"reward/mean": 0.1 * s, "response_length/mean": 5.0, "actor/pg_loss": -0.01, "timing/step": 0.5}
        for s in range(1, 4)]  # fmt: skip


@pytest.fixture(autouse=True)
def wandb_env(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))


def _run(out_dir, mode, enabled=True, rows=ROWS):
    cfg = LoggingConfig(wandb=WandbConfig(mode=mode, project="t"), progress_bar=False)
    with Tracker(cfg, str(out_dir), run_config={"a": 1}, total_steps=len(rows), enabled=enabled) as tracker:
        tracker.write_text("config.yaml", "a: 1\n")
        for step, row in enumerate(rows, 1):
            tracker.log(step, row)
        png = tracker.finish(["done"])
    return png


def test_jsonl_console_png_and_plot(tmp_path, capsys):
    rows = ROWS[:2] + [{**ROWS[2], "actor/pg_loss": float("nan")}]
    png = _run(tmp_path / "run", "disabled", rows=rows)
    got = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in got] == [1, 2, 3] and got[0]["reward/mean"] == pytest.approx(0.1)
    assert got[2]["actor/pg_loss"] is None  # NaN is not JSON: written as null
    out = capsys.readouterr().out
    assert "[megarl] step 2/3 reward 0.200 len 5.0 pg_loss -0.0100 0.50s" in out and "[megarl] done" in out
    assert open(png, "rb").read(8) == PNG and not (tmp_path / "run" / "wandb").exists()
    os.remove(png)
    assert megarl_main(["plot", str(tmp_path / "run")]) == 0 and open(png, "rb").read(8) == PNG
    assert megarl_main(["plot", str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_wandb_offline_run_holds_every_logged_value(tmp_path):
    _run(tmp_path / "run", "offline")
    runs = [d for d in os.listdir(tmp_path / "run" / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1
    run_file = str(next((tmp_path / "run" / "wandb" / runs[0]).glob("run-*.wandb")))
    # complete when the tracker returns: the run's exit record is the file's last (CI once read it before the service
    # had written it: no history rows)
    assert [r.WhichOneof("record_type") for r in records(run_file)][-1] == "exit"
    logged = history(run_file)
    assert [h["_step"] for h in logged] == [1, 2, 3]
    for h, row in zip(logged, ROWS):
        assert {k: h[k] for k in row} == pytest.approx(row)


def test_other_ranks_write_nothing(tmp_path, capsys):
    assert _run(tmp_path / "run", "offline", enabled=False) is None
    assert not (tmp_path / "run").exists() and capsys.readouterr().out == ""


def test_config_yaml_is_written(tmp_path):
    _run(tmp_path / "run", "disabled")
    assert (tmp_path / "run" / "config.yaml").read_text() == "a: 1\n"
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_a_row_cut_short_by_a_kill_is_left_out(tmp_path):
    """Every row megarl writes ends with a newline: a last line without one is a write a kill cut short."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    assert read_metrics(str(path)) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]
    path.write_text('{"step": 1, "a": 1.0}\n')
    assert read_metrics(str(path)) == [{"step": 1, "a": 1.0}]
