"""LoRA checks that need no process group: the config, what init_from refuses, what resume refuses."""

import json

import pytest

from megarl.config import load_config
from megarl.config.loader import ConfigError
from megarl.lora import read_peft_adapter
from megarl.models.spec import ModelSpec
from megarl.run.job import _check_lora, lora_identity
from megarl.run.resume import ResumeError


def _lora(*overrides):
    return load_config(None, ["model.path=x", "actor.lora.rank=4", *overrides]).actor.lora


def test_lora_config_defaults_and_refusals():
    lora = _lora()
    assert lora.scaling == 2.0 and len(lora.target_modules) == 7  # alpha = 2 x rank, every linear
    assert load_config(None, ["model.path=x"]).actor.lora is None
    with pytest.raises(ConfigError, match=r"actor.lora.dropout: must be 0 for RL"):
        _lora("actor.lora.dropout=0.05")
    with pytest.raises(ConfigError, match=r"actor.lora.target_modules: unknown \['qkv_proj'\]"):
        _lora("actor.lora.target_modules=[qkv_proj]")


@pytest.mark.parametrize("option, value", [("use_rslora", True), ("use_dora", True), ("rank_pattern", {"q_proj": 8}),
                                           ("layers_to_transform", [0]), ("lora_bias", True)])  # fmt: skip
def test_init_from_refuses_peft_options_that_change_the_math(tmp_path, option, value):
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], option: value}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    spec = ModelSpec(family="llama", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                     ffn_hidden_size=128, vocab_size=100, padded_vocab_size=128, max_position_embeddings=512,
                     rope_theta=1e4, rope_scaling_factor=None, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     qkv_bias=False)  # fmt: skip
    with pytest.raises(ValueError, match=f"sets {option}, which megarl's adapters do not compute"):
        read_peft_adapter(str(tmp_path), _lora("actor.lora.target_modules=[q_proj]"), spec)


def test_resume_refuses_other_adapters_or_a_mismatched_checkpoint():
    lora = _lora()
    base = {"decoder.final_layernorm.weight": [64.0, 64.0]}
    saved = {"lora_base": base, "lora": lora_identity(lora)}
    _check_lora("ckpt", saved, lora, base)  # the same: fine
    with pytest.raises(ResumeError, match=r"holds adapters of rank 4, alpha 8.*actor.lora must match"):
        _check_lora("ckpt", saved, _lora("actor.lora.alpha=16"), base)
    with pytest.raises(ResumeError, match="trained on another base model"):
        _check_lora("ckpt", saved, lora, {"decoder.final_layernorm.weight": [64.0, 70.0]})
    with pytest.raises(ResumeError, match="holds full fine-tuning but actor.lora is set"):
        _check_lora("ckpt", {}, lora, base)


def test_lora_sync_mode_refusals():
    from megarl.config.validate import _lora_errors, adapter_slots

    spec = ModelSpec(family="llama", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                     ffn_hidden_size=128, vocab_size=100, padded_vocab_size=128, max_position_embeddings=512,
                     rope_theta=1e4, rope_scaling_factor=None, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     qkv_bias=False)  # fmt: skip

    def errors(*overrides):
        cfg = load_config(None, ["model.path=x", *overrides])
        return " | ".join(_lora_errors(cfg, spec)), adapter_slots(cfg)

    assert errors("actor.lora.rank=4") == ("", False)  # auto: merged into a colocated engine
    assert errors("actor.lora.rank=4", "rollout.lora_merge=false") == ("", True)
    assert "rollout.lora_merge: true without actor.lora" in errors("rollout.lora_merge=true")[0]
    assert "needs rollout.backend=vllm" in errors("actor.lora.rank=4", "rollout.lora_merge=false",
                                                  "rollout.backend=hf")[0]  # fmt: skip
    assert "vLLM's LoRA slots hold rank <= 512" in errors("actor.lora.rank=600", "rollout.lora_merge=false")[0]
    assert errors("actor.lora.rank=600")[0] == ""  # merged: any rank
    with pytest.raises(ConfigError, match="rollout.lora_merge: must be one of"):
        load_config(None, ["model.path=x", "rollout.lora_merge=maybe"])


def test_adapters_on_one_tp_rank_skip_megatrons_tp_mappings():
    """At TP=1 an adapter's ``delta`` is scaling * B (A x) with no TP-mapping autograd function in its graph (their
    all-reduce is skipped on one rank; the function would still be one more node forward and backward per call), for
    a column-parallel linear (fused q/k/v) and a row-parallel one. No process group is needed there."""
    from types import SimpleNamespace

    import torch

    from megarl.lora.adapters import MODULES, LinearAdapters, fresh_factors
    from tests.attention_worker import graph_nodes

    spec = SimpleNamespace(hidden_size=16, head_dim=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=24)

    gen = torch.Generator().manual_seed(0)
    for module in ("self_attention.linear_qkv", "self_attention.linear_proj"):
        style, targets, _ = MODULES[module]
        factors = {t: fresh_factors(spec, t, 2, 0, seed=1) for t in targets}
        for f in factors.values():
            f["B"] = torch.randn(f["B"].shape, generator=gen)
        adapters = LinearAdapters(style, targets, factors, 0.5, spec, tp=1)
        x = torch.randn(3, 2, factors[targets[0]]["A"].shape[1], generator=gen)
        delta = adapters.delta(x)
        expected = torch.cat([0.5 * x @ factors[t]["A"].T @ factors[t]["B"].T for t in targets], -1)
        if targets == ("q_proj", "k_proj", "v_proj"):  # Megatron's fused layout: per query group [q; k; v]
            blocks = [e.reshape(3, 2, spec.num_kv_heads, -1) for e in expected.split([16, 8, 8], -1)]
            expected = torch.cat(blocks, -1).reshape(3, 2, -1)
        torch.testing.assert_close(delta, expected)
        assert not [n for n in graph_nodes(delta) if "ModelParallelRegion" in n], graph_nodes(delta)
