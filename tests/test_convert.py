"""checkpoints_tools: HF <-> Megatron at any TP/PP with logit parity, bitwise round trips, refusals, CLIs."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.convert.checks import ConversionError, check_output_dir
from megarl.convert.hf_io import HFWeights
from megarl.convert.hf_to_megatron import check_hf_source
from megarl.models.tiny import make_tiny_hf_model
from megarl.parallel.spawn import run_on_ranks
from tests.convert_worker import LOAD_LAYOUTS, MOE_LAYOUTS, family_of, run_conversions

FAMILIES = {"llama": {}, "qwen2": {"tie_word_embeddings": True}, "mistral": {}, "qwen3": {},
            "qwen3_tied": {"tie_word_embeddings": True}, "qwen3_moe": {},
            "qwen3_moe_unnorm": {"moe": {"norm_topk_prob": False}},
            "qwen3_moe_mixed": {"moe": {"mlp_only_layers": [1]}}}  # fmt: skip
"""Models by name (the family is the name up to a known suffix): qwen3 with q/k norms and head_dim 64 with 4 heads of
hidden 128, tied and untied; qwen3_moe with 8 experts, top-2, probabilities renormalised or not, and a mixed model
whose layer 1 is dense. MoE models load at TP=1 only (``MOE_LAYOUTS``)."""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    hf_dirs = {f: make_tiny_hf_model(str(root / f"{f}-src"), family_of(f), seed=3, **kw) for f, kw in FAMILIES.items()}
    corrupted = str(root / "llama-corrupted-src")
    shutil.copytree(hf_dirs["llama"], corrupted)
    weights = load_file(os.path.join(corrupted, "model.safetensors"))
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    weights[gate], weights[up] = weights[up].clone(), weights[gate].clone()
    save_file(weights, os.path.join(corrupted, "model.safetensors"), metadata={"format": "pt"})
    results = run_on_ranks(run_conversions, 4, hf_dirs, corrupted, str(root))
    return {"root": str(root), "hf_dirs": hf_dirs, "results": results}


@pytest.mark.parametrize(
    "family,layout",
    [(f, lay) for f in sorted(FAMILIES) for lay in sorted(MOE_LAYOUTS if "moe" in f else LOAD_LAYOUTS)],
)
def test_logits_match_hf(work, family, layout):
    r = work["results"][family, layout]
    assert r["passed"] and r["max_abs_diff"] <= 1e-5, r


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_is_bitwise(work, family):
    src, back = HFWeights(work["hf_dirs"][family]), HFWeights(os.path.join(work["root"], f"{family}-hf"))
    assert src.names == back.names
    for name in sorted(src.names):
        a, b = src.get(name), back.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_exported_dir_loads_in_transformers(work):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = os.path.join(work["root"], "qwen2-hf")
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1  # sharded
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings and type(model).__name__ == "Qwen2ForCausalLM"
    src_tok, out_tok = AutoTokenizer.from_pretrained(work["hf_dirs"]["qwen2"]), AutoTokenizer.from_pretrained(out)
    assert out_tok.get_vocab() == src_tok.get_vocab() and out_tok("a b").input_ids == src_tok("a b").input_ids
    ref = AutoModelForCausalLM.from_pretrained(work["hf_dirs"]["qwen2"])
    tokens = torch.randint(0, 320, (1, 20))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref(tokens).logits)


def test_written_at_tp2_loads_at_tp1_and_pp2(work):
    res = work["results"]
    assert res["tp2_written", "tp1pp1"]["passed"] and res["tp2_written", "tp1pp2"]["passed"]
    assert res["tp2_written_state_equal"]


def test_an_moe_model_written_at_pp2_ep2_loads_at_pp1_ep1_and_is_refused_at_tp2(work):
    res = work["results"]
    assert res["moe_pp2_written", "tp1pp1"]["passed"] and res["moe_pp2_written_state_equal"]
    assert "an MoE model trains at tp=1" in res["moe_tp2_refused"], res["moe_tp2_refused"]


def test_swapped_gate_up_fails_verification(work):
    r = work["results"]["corrupt"]
    assert not r["passed"] and r["max_abs_diff"] > 100 * r["tolerance"], r


def test_refusals(tmp_path, work):
    bad = tmp_path / "gpt2"
    shutil.copytree(work["hf_dirs"]["llama"], bad)
    cfg = (bad / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt2"')
    (bad / "config.json").write_text(cfg)
    with pytest.raises(ConversionError, match="model_type='gpt2' is not supported"):
        check_hf_source(str(bad))
    small = make_tiny_hf_model(str(tmp_path / "small-vocab"), "llama", vocab_size=200)
    with pytest.raises(ConversionError, match="the tokenizer .* has 259 tokens but the model's vocab_size is 200"):
        check_hf_source(small)
    with pytest.raises(ConversionError, match="already holds a checkpoint; pass --overwrite"):
        check_output_dir(os.path.join(work["root"], "llama-ckpt"), overwrite=False)
    check_output_dir(os.path.join(work["root"], "llama-ckpt"), overwrite=True)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(ConversionError, match="not empty and is not a megarl checkpoint"):
        check_output_dir(str(tmp_path / "junk"), overwrite=True)


def _tool(name, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, f"checkpoints_tools/{name}.py", *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_cli_convert_verify_export(work, tmp_path):
    src = work["hf_dirs"]["mistral"]
    out = _tool("hf_to_megatron", "--hf-dir", src, "--out", str(tmp_path / "ck"))
    assert out.returncode == 0 and "wrote mistral checkpoint" in out.stdout, out.stderr[-2000:]
    assert not os.path.exists(tmp_path / "ck.tmp")
    again = _tool("hf_to_megatron", "--hf-dir", src, "--out", str(tmp_path / "ck"))
    assert again.returncode == 2 and "already holds a checkpoint" in again.stderr
    ok = _tool("verify", "--hf-dir", src, "--ckpt", str(tmp_path / "ck"), "--tp", "2")
    assert ok.returncode == 0 and ok.stdout.startswith("PASS"), ok.stderr[-2000:]
    exported = _tool("megatron_to_hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert HFWeights(str(tmp_path / "hf")).names == HFWeights(src).names


def test_cli_verify_reports_fail(work):
    bad = _tool("verify", "--hf-dir", work["hf_dirs"]["llama"], "--ckpt", os.path.join(work["root"], "corrupt-ckpt"))
    assert bad.returncode == 1 and bad.stdout.startswith("FAIL"), bad.stderr[-2000:]


def test_bf16_safetensors_convert_verify_and_export_bitwise(work, tmp_path):
    """An HF model stored in bf16 (the production dtype): converted at TP=2, verified against transformers in bf16,
    exported back: every tensor bitwise and still bf16 (norms included)."""
    import json

    src = str(tmp_path / "llama-bf16")
    shutil.copytree(work["hf_dirs"]["llama"], src)
    weights = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, os.path.join(src, "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    config = json.load(open(os.path.join(src, "config.json")))
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    out = _tool("hf_to_megatron", "--hf-dir", src, "--out", str(tmp_path / "ck"), "--tp", "2")
    assert out.returncode == 0 and "(dtype bfloat16," in out.stdout, out.stdout + out.stderr[-2000:]
    ok = _tool("verify", "--hf-dir", src, "--ckpt", str(tmp_path / "ck"), "--tp", "2")
    assert ok.returncode == 0 and ok.stdout.startswith("PASS"), ok.stdout + ok.stderr[-2000:]
    exported = _tool("megatron_to_hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    a, b = HFWeights(src), HFWeights(str(tmp_path / "hf"))
    assert a.names == b.names
    for name in sorted(a.names):
        assert a.get(name).dtype == b.get(name).dtype == torch.bfloat16 and torch.equal(a.get(name), b.get(name)), name


def test_cli_refuses_ep_on_a_dense_model_and_one_not_dividing_the_experts(work, tmp_path):
    dense = _tool("hf_to_megatron", "--hf-dir", work["hf_dirs"]["llama"], "--out", str(tmp_path / "a"), "--ep", "2")
    assert dense.returncode == 2 and "--ep=2: llama has no routed experts to split" in dense.stderr, dense.stderr
    moe = _tool("verify", "--hf-dir", work["hf_dirs"]["qwen3_moe"], "--ckpt", os.path.join(work["root"],
                "qwen3_moe-ckpt"), "--ep", "3")  # fmt: skip
    assert moe.returncode == 2 and "--ep=3: does not divide the model's 8 experts" in moe.stderr, moe.stderr
    assert len(moe.stderr.strip().splitlines()) == 1
