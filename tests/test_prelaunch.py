"""Errors before launch are one line, fast: the config, its validation and every command's path up to its checks load
no heavy library (megatron-core, vLLM, transformers' model code, torch's distributed package, which ``import torch``
loads), and each bad input ends as one ``megarl: ...`` line with exit status 2 before any of them is loaded."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("megatron", "vllm", "transformers.models", "torch.distributed")
PRELAUNCH = (
    "megarl.cli",
    "megarl.config",
    "megarl.config.validate",
    "megarl.run.cli",
    "megarl.planner.cli",
    "megarl.launch.cli",
    "megarl.convert.cli",
    "megarl.convert.fetch",
)
"""The command line, the config and each command's module: what runs before a bad input is refused."""

RUN = (
    "import sys\n"
    "from megarl.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    "sys.exit(rc)\n"
)
"""``megarl ARGS`` as its console script runs it, then the heavy modules it loaded, on stdout."""


def _python(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_prelaunch_modules_load_no_heavy_library():
    code = f"import sys\nimport {', '.join(PRELAUNCH)}\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = _python("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    assert out.stderr == ""


@pytest.fixture(scope="module")
def recipes(tiny_llama_dir, tmp_path_factory):
    """A tab-indented recipe, and the quickstart on the tiny model (its path made absolute)."""
    d = tmp_path_factory.mktemp("prelaunch")
    (d / "tab.yaml").write_text("trainer:\n\ttotal_steps: 3\n")
    (d / "tiny.yaml").write_text(f"base: {ROOT}/configs/tiny_grpo.yaml\nmodel:\n  path: {tiny_llama_dir}\n")
    (d / "ckpt").mkdir()
    return d


def _bad_inputs(d) -> dict[str, list[str]]:
    tiny = str(d / "tiny.yaml")
    return {
        "train: tab in the YAML": ["train", str(d / "tab.yaml")],
        "train: unknown key": ["train", tiny, "trainer.totl_steps=3"],
        "train: invalid value": ["train", tiny, "actor.optim.lr=inf"],
        "train: override without '='": ["train", tiny, "trainer.total_steps"],
        "train: missing recipe": ["train", str(d / "nowhere.yaml")],
        "train: missing model": ["train", tiny, f"model.path={d}/no-model"],
        "train: layout": ["train", tiny, "actor.parallel.tp=3"],
        "plan: layout": ["plan", tiny, "actor.parallel.pp=3"],
        "plan: unknown key": ["plan", tiny, "actor.paralel.tp=2"],
        "launch torchrun: layout": ["launch", "torchrun", tiny, "--nnodes", "1", "--node-rank", "0",
                                    "--master-addr", "localhost", "actor.parallel.tp=3"],  # fmt: skip
        "launch slurm: missing recipe": ["launch", "slurm", str(d / "nowhere.yaml"), "--nodes", "1",
                                         "--gpus-per-node", "2"],
        "convert hf-to-megatron: missing model": ["convert", "hf-to-megatron", "--hf-dir", str(d / "no-model"),
                                                  "--out", str(d / "out")],  # fmt: skip
        "convert megatron-to-hf: no checkpoint": ["convert", "megatron-to-hf", "--ckpt", str(d / "ckpt"),
                                                  "--out", str(d / "hf")],  # fmt: skip
        "convert verify: no checkpoint": ["convert", "verify", "--hf-dir", str(d / "no-model"), "--ckpt",
                                          str(d / "ckpt")],  # fmt: skip
        "fetch-model: missing folder": ["fetch-model", str(d / "no-model"), "--out", str(d / "fetched")],
    }


def test_each_bad_input_is_one_line_and_status_2_before_any_heavy_library(recipes):
    failures = []
    for name, argv in _bad_inputs(recipes).items():
        out = _python("-c", RUN, *argv, cwd=str(recipes))
        lines = out.stderr.splitlines()
        loaded = out.stdout.strip().splitlines()[-1:] or ["(nothing)"]
        if out.returncode != 2 or len(lines) != 1 or not lines[0].startswith("megarl: ") or loaded != ["[]"]:
            failures.append(f"{name}: rc {out.returncode}, loaded {loaded[0]}, stderr {json.dumps(out.stderr)}")
    assert failures == [], "\n".join(failures)
