"""The `megarl` command: help, config errors before any process starts, and the demo's training run."""

import os
import re
import subprocess
import sys


def _megarl(*args, cwd=None, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "megarl.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )


def test_help_lists_subcommands():
    out = _megarl("--help")
    assert out.returncode == 0 and "train" in out.stdout and "tiny-model" in out.stdout


def test_config_error_exits_before_launch(tiny_llama_dir):
    out = _megarl("train", "configs/quickstart.yaml", f"model.path={tiny_llama_dir}", "actor.parallel.tp=8")
    assert out.returncode == 2
    assert "actor.parallel.tp=8 does not divide the model's 4 attention heads" in out.stderr
    assert "launching" not in out.stdout


def test_quickstart_trains_at_tp2(tiny_llama_dir):
    out = _megarl("train", "configs/quickstart.yaml", f"model.path={tiny_llama_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "launching 2 local ranks" in out.stdout
    losses = [float(x) for x in re.findall(r"step \d+/5 loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.5
