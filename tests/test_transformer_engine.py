"""Transformer Engine's layer spec on CPU, through a stand-in with TE's parameter names, fused norm and return
convention (``tests/te_standin.py``; TE itself needs a GPU): HF loading, the weight sync's tensors, and LoRA on the
fused norm + linear, against the local spec and HF + peft."""

from __future__ import annotations

import pytest
import torch

from megarl.parallel.spawn import run_on_ranks
from tests.te_standin import te_case


@pytest.fixture(scope="module")
def tp2(lora_llama_dir, random_adapter_dir):
    return run_on_ranks(te_case, 2, lora_llama_dir, random_adapter_dir, 2)


def test_te_names_load_from_hf_and_feed_the_weight_sync(tp2):
    names = tp2["names"]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)  # TE's names, not the local's
    assert tp2["sync_names_match_layout"]  # the actor's tensors are the reshard layout's sources
    assert tp2["sync_tensors_equal"]  # ... and equal the local-spec chunk's
    assert torch.equal(tp2["base"], tp2["base_local"])  # same forward


def test_lora_on_te_fused_norm_linear_equals_merged_weights_and_peft(tp2, lora_llama_dir, random_adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_hf = AutoModelForCausalLM.from_pretrained(lora_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base_hf, random_adapter_dir)(tp2["tokens"]).logits.float()
    adapted, merged = torch.log_softmax(tp2["adapted"], -1), torch.log_softmax(tp2["merged"], -1)
    assert (adapted - torch.log_softmax(peft_logits, -1)).abs().max() <= 1e-5  # the adapters see the normed input
    assert (adapted - merged).abs().max() <= 1e-5  # what the sync hands vLLM computes the same
    assert (adapted - torch.log_softmax(tp2["base"], -1)).abs().max() > 1e-2  # the adapter's effect is visible
    off = torch.log_softmax(tp2["adapters_off"], -1)  # adapters off: the base model (the LoRA reference)
    assert (off - torch.log_softmax(tp2["base"], -1)).abs().max() <= 1e-5
    assert tp2["factors_equal"] and tp2["factor_grads_nonzero"] and tp2["factor_grads_equal"]


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    from megarl.models.tiny import make_tiny_hf_model
    from tests.te_standin import te_grouped_experts_case

    hf_dir = make_tiny_hf_model(str(tmp_path_factory.mktemp("te-grouped") / "moe"), "qwen3_moe")
    return hf_dir, run_on_ranks(te_grouped_experts_case, 2, hf_dir)


def test_te_grouped_expert_names_load_from_hf_sync_and_export_bitwise(grouped):
    """TEGroupedMLP's names (``mlp.experts.linear_fc1.weight{j}``) at EP=2: loaded from HF through the one name map,
    the weight sync's tensors are the layout's sources and the local spec's, the same logits, and the experts of
    both ranks export to the HF tensors bitwise."""
    from megarl.convert.hf_io import HFWeights

    hf_dir, r = grouped
    assert r["grouped_layers"] == 2
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in r["names"]
    assert not any("local_experts" in n for n in r["names"])
    assert r["sync_names_match_layout"] and r["sync_tensors_equal"]
    assert torch.equal(r["logits"], r["logits_local"])
    source = HFWeights(hf_dir)
    assert set(r["exported"]) == source.names
    assert [n for n in sorted(source.names) if not torch.equal(r["exported"][n], source.get(n))] == []
