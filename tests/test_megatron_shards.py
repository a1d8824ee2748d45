"""TP/PP split rules for Megatron parameters (pure; the parity tests check them against real modules)."""

import torch

from megarl.parallel import megatron_shards as ms


def test_gate_up_is_split_per_half():
    gate, up = torch.arange(8.0).reshape(8, 1), 100 + torch.arange(8.0).reshape(8, 1)
    full = torch.cat([gate, up])
    r1 = ms.shard(full, ms.GATE_UP, 1, 2)
    assert r1.flatten().tolist() == [4.0, 5.0, 6.0, 7.0, 104.0, 105.0, 106.0, 107.0]
    assert torch.equal(r1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    assert torch.equal(ms.merge([ms.shard(full, ms.GATE_UP, r, 2) for r in range(2)], ms.GATE_UP), full)


def test_rules_by_name():
    assert ms.tp_split("decoder.layers.0.self_attention.linear_qkv.weight") == ms.ROWS
    assert ms.tp_split("decoder.layers.0.self_attention.linear_qkv.bias") == ms.ROWS
    assert ms.tp_split("decoder.layers.0.self_attention.linear_proj.weight") == ms.COLS
    assert ms.tp_split("decoder.layers.0.mlp.linear_fc2.weight") == ms.COLS
    assert ms.tp_split("decoder.layers.0.mlp.linear_fc1.weight") == ms.GATE_UP
    assert ms.tp_split("decoder.layers.0.input_layernorm.weight") == ms.REPLICATED
    assert ms.tp_split("embedding.word_embeddings.weight") == ms.ROWS
    assert ms.tp_split("output_layer.weight") == ms.ROWS
    assert ms.tp_split("output_layer.weight", value_head=True) == ms.REPLICATED


def test_local_and_full_state_dict_round_trip_with_tied_pp():
    full = {
        "embedding.word_embeddings.weight": torch.randn(8, 4),
        "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(8, 4),
        "decoder.layers.1.mlp.linear_fc2.weight": torch.randn(4, 4),
        "decoder.final_layernorm.weight": torch.randn(4),
    }
    locals_ = {}
    for pp_rank in range(2):
        for tp_rank in range(2):
            stage = ms.StageInfo(pp_rank, 2, 2)
            locals_[(tp_rank, pp_rank, 0)] = ms.local_state_dict(full, stage, tp_rank, 2, tied_embeddings=True)
    assert set(locals_[(0, 1, 0)]) == {
        "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    }
    assert torch.equal(locals_[(1, 1, 0)]["output_layer.weight"], full["embedding.word_embeddings.weight"][4:])
    back = ms.full_state_dict(locals_, 2, 2, 2, tied_embeddings=True)
    assert back.keys() == full.keys()
    assert all(torch.equal(back[k], full[k]) for k in full)


def test_experts_split_over_ep_ranks_and_merge_back():
    """EP=2 x PP=2, 4 experts per layer: EP rank e holds experts 2e and 2e+1 of its stage's layers, renumbered 0, 1."""
    full = {"decoder.layers.0.mlp.router.weight": torch.randn(4, 4)}
    for i in range(2):
        for j in range(4):
            full[f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight"] = torch.randn(8, 4)
    locals_ = {}
    for pp_rank in range(2):
        for ep_rank in range(2):
            stage = ms.StageInfo(pp_rank, 2, 2, ep_rank, 2, num_experts=4)
            locals_[(0, pp_rank, ep_rank)] = ms.local_state_dict(full, stage, 0, 1)
    name = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert set(locals_[(0, 1, 1)]) == {name.format(0), name.format(1)}
    assert torch.equal(locals_[(0, 1, 1)][name.format(1)], full[name.replace("0.mlp", "1.mlp").format(3)])
    assert "decoder.layers.0.mlp.router.weight" in locals_[(0, 0, 1)]  # dense tensors on every EP rank
    back = ms.full_state_dict(locals_, 1, 2, 2, ep=2, num_experts=4)
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
