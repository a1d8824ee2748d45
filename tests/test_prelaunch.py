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
    lora = d / "lora-ckpt"  # a LoRA training checkpoint's metadata and pointer (its weights are not read)
    (lora / "iter_0000001").mkdir(parents=True)
    (lora / "iter_0000001" / "metadata.json").write_text("{}")
    (lora / "latest").write_text("iter_0000001\n")
    (lora / "megarl_checkpoint.json").write_text(json.dumps({"format_version": 1, "lora": {"rank": 4}}))
    (d / "moe").mkdir()  # a Qwen3-MoE's config
    (d / "moe" / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256, "vocab_size": 320, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}))  # fmt: skip
    return d


def _bad_inputs(d) -> dict[str, list[str]]:
    tiny = str(d / "tiny.yaml")
    return {
        "train: tab in the YAML": ["train", str(d / "tab.yaml")],
        "train: unknown key": ["train", tiny, "trainer.totl_steps=3"],
        "train: invalid value": ["train", tiny, "actor.optim.lr=inf"],
        "train: unknown packing": ["train", tiny, "actor.packing=shortest"],
        "train: override without '='": ["train", tiny, "trainer.total_steps"],
        "train: missing recipe": ["train", str(d / "nowhere.yaml")],
        "train: missing model": ["train", tiny, f"model.path={d}/no-model"],
        "train: layout": ["train", tiny, "actor.parallel.tp=3"],
        "train: LoRA on an MoE model's MLP": ["train", tiny, f"model.path={d}/moe", "actor.lora.rank=4",
                                              "actor.lora.target_modules=[q_proj,gate_proj]"],  # fmt: skip
        "train: an MoE model at TP=2": ["train", tiny, f"model.path={d}/moe", "actor.parallel.tp=2"],
        "plan: layout": ["plan", tiny, "actor.parallel.pp=3"],
        "plan: unknown key": ["plan", tiny, "actor.paralel.tp=2"],
        "plan: hardware option": ["plan", tiny, "--gpus-per-node", "-1"],
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
        "convert megatron-to-hf: LoRA without --lora": ["convert", "megatron-to-hf", "--ckpt", str(d / "lora-ckpt"),
                                                        "--out", str(d / "hf")],  # fmt: skip
        "convert verify: --tp 0": ["convert", "verify", "--hf-dir", str(d / "no-model"), "--ckpt", str(d / "ckpt"),
                                   "--tp", "0"],  # fmt: skip
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


def test_on_cuda_asks_the_cuda_driver_until_torch_is_loaded(tmp_path):
    """Before torch is imported, ``on_cuda`` asks what ``torch.cuda.is_available()`` would: a CUDA build of torch
    (its version file) and a device the driver counts (a stand-in driver compiled here answers 2, or fails cuInit)."""
    import torch

    from megarl.config import device_defaults

    assert device_defaults.torch_build() == ("cuda" if torch.version.cuda else "other" if torch.version.hip else "cpu")
    for name, init, count in (("two", 0, 2), ("no-device", 100, 0)):  # 100: CUDA_ERROR_NO_DEVICE
        (tmp_path / f"{name}.c").write_text(
            f"int cuInit(unsigned flags) {{ return {init}; }}\n"
            f"int cuDeviceGetCount(int *n) {{ *n = {count}; return 0; }}\n"
        )
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / f"lib{name}.so"), str(tmp_path / f"{name}.c")],
                       check=True)  # fmt: skip
    assert device_defaults.driver_devices(str(tmp_path / "libtwo.so")) == 2
    assert device_defaults.driver_devices(str(tmp_path / "libno-device.so")) == 0
    assert device_defaults.driver_devices(str(tmp_path / "libabsent.so")) == 0
    ask = (
        "import sys\n"
        "from megarl.config import device_defaults as d\n"
        "d.torch_build = lambda: 'cuda'  # a CUDA build of torch, with the stand-in driver below\n"
        f"d.LIBCUDA = {str(tmp_path / 'libtwo.so')!r}\n"
        "print(d.on_cuda(), 'torch' in sys.modules)\n"
    )
    assert _python("-c", ask).stdout.split() == ["True", "False"]
    here = "import sys\nfrom megarl.config.device_defaults import on_cuda\nfirst = on_cuda()\nimport torch\n" \
           "print(first, on_cuda(), torch.cuda.is_available())"  # fmt: skip
    assert len(set(_python("-c", here).stdout.split())) == 1  # the driver's answer is torch's, on this machine


QUIET = '''
import logging, warnings
import megarl
from megarl.compat import quiet
import megatron.core.optimizer, megatron.core.optimizer.clip_grads, megatron.core.distributed
warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "backends.py", 21,
                       module="megatron.core.models.backends")
warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "elsewhere.py", 1,
                       module="elsewhere")  # the same message from another module still shows
warnings.warn_explicit("another megatron warning", UserWarning, "optimizer.py", 1, module="megatron.core.optimizer")
quiet.quiet_vllm_logs()
logging.getLogger("vllm.config.vllm").warning("Model Runner V2 requires Triton; using the V1 model runner instead.")
logging.getLogger("vllm.config.vllm").warning("a vLLM warning a user can act on")
print(quiet.implementations("local"))
'''


def test_the_start_up_silences_exactly_the_fallback_notes():
    out = _python("-c", QUIET)
    assert out.returncode == 0, out.stderr
    assert "Transformer Engine and Apex" not in out.stderr and "Model Runner V2" not in out.stderr, out.stderr
    assert out.stderr.count("Apex is not installed. Falling back to Torch Norm") == 1, out.stderr
    assert "elsewhere.py" in out.stderr and "another megatron warning" in out.stderr, out.stderr
    assert "a vLLM warning a user can act on" in out.stderr, out.stderr
    assert out.stdout.strip() == ("layers: megatron-core local spec (torch norms); optimizer: torch AdamW, local "
                                  "multi-tensor ops (Transformer Engine and Apex are not installed)")  # fmt: skip
