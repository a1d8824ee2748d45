"""Runs inside each of 4 spawned ranks: conversions and logit checks for every family, sharing one process group."""

from __future__ import annotations

import torch

from megarl.checkpoint import read_meta
from megarl.checkpoint.weights import load_model
from megarl.convert.hf_to_megatron import convert_hf_to_megatron
from megarl.convert.megatron_to_hf import convert_megatron_to_hf
from megarl.convert.verify import verify_checkpoint
from megarl.models.builder import build_model_chunk
from megarl.models.family import UnsupportedModelError
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout as L

# (TP, PP) layouts to load at; the remaining factor of the 4 ranks is DP (replicas compute the same logits).
LOAD_LAYOUTS = {"tp1pp1": L(dp=4), "tp2pp1": L(tp=2, dp=2), "tp1pp2": L(pp=2, dp=2), "tp2pp2": L(tp=2, pp=2)}
MOE_LAYOUTS = {**{name: LOAD_LAYOUTS[name] for name in ("tp1pp1", "tp1pp2")},
               "ep2": L(dp=4, ep=2), "ep2pp2": L(pp=2, dp=2, ep=2)}  # fmt: skip
"""An MoE model is built at TP=1 only: at DP=4, at PP=2 x DP=2, and with its experts split over EP=2 (a checkpoint
written at EP=1 read at EP=2)."""


def family_of(model: str) -> str:
    """The family of a test model named ``family`` or ``family_variant`` (qwen3_moe_mixed -> qwen3_moe)."""
    from megarl.models.family import FAMILIES

    return max((f for f in FAMILIES if model == f or model.startswith(f + "_")), key=len)


def _full_state(ckpt_dir: str) -> dict[str, torch.Tensor]:
    layout = L(dp=4)
    init_distributed(layout)
    meta = read_meta(ckpt_dir)
    chunk = build_model_chunk(spec_from_hf_config(meta["hf_config"]), layout, init_weights=False)
    load_model(ckpt_dir, chunk)
    return {k: v.clone() for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}


def run_conversions(hf_dirs: dict[str, str], corrupted_dir: str, root: str) -> dict:
    results = {}
    for family, hf_dir in hf_dirs.items():
        ckpt = f"{root}/{family}-ckpt"
        convert_hf_to_megatron(hf_dir, ckpt, L(dp=4))  # written at TP=1, PP=1
        for name, layout in (MOE_LAYOUTS if "moe" in family else LOAD_LAYOUTS).items():
            results[(family, name)] = verify_checkpoint(hf_dir, ckpt, layout)
        convert_megatron_to_hf(ckpt, f"{root}/{family}-hf", L(dp=4), max_shard_bytes=100_000)

    # written at TP=2, loaded at TP=1 and at PP=2
    convert_hf_to_megatron(hf_dirs["llama"], f"{root}/llama-tp2-ckpt", L(tp=2, dp=2))
    results["tp2_written", "tp1pp1"] = verify_checkpoint(hf_dirs["llama"], f"{root}/llama-tp2-ckpt", L(dp=4))
    results["tp2_written", "tp1pp2"] = verify_checkpoint(hf_dirs["llama"], f"{root}/llama-tp2-ckpt", L(pp=2, dp=2))
    a, b = _full_state(f"{root}/llama-ckpt"), _full_state(f"{root}/llama-tp2-ckpt")
    results["tp2_written_state_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # an MoE model written at PP=2 x EP=2 loads at PP=1, EP=1 (the same tensors); at TP=2 it is refused in one line
    moe, ck = hf_dirs["qwen3_moe_mixed"], f"{root}/moe-pp2-ckpt"
    convert_hf_to_megatron(moe, ck, L(pp=2, dp=2, ep=2))
    results["moe_pp2_written", "tp1pp1"] = verify_checkpoint(moe, ck, L(dp=4))
    a, b = _full_state(f"{root}/qwen3_moe_mixed-ckpt"), _full_state(ck)
    results["moe_pp2_written_state_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    try:
        verify_checkpoint(moe, ck, L(tp=2, dp=2))
        results["moe_tp2_refused"] = "not refused"
    except UnsupportedModelError as e:
        results["moe_tp2_refused"] = str(e)

    # gate and up swapped in layer 0 of the source: verify must FAIL against the true model
    convert_hf_to_megatron(corrupted_dir, f"{root}/corrupt-ckpt", L(dp=4))
    results["corrupt"] = verify_checkpoint(hf_dirs["llama"], f"{root}/corrupt-ckpt", L(dp=4))
    return results
