"""megarl checkpoint -> HF directory (config.json, sharded safetensors + index, tokenizer files)."""

from __future__ import annotations

import functools
import json
import os
import shutil

import torch.distributed as dist
from tqdm import tqdm

from megarl.checkpoint import format as ckpt
from megarl.checkpoint.weights import load_model
from megarl.convert.checks import check_export_dir
from megarl.convert.hf_io import ShardedSafetensorsWriter, copy_tokenizer_files
from megarl.models.adapter import tensor_maps, to_hf
from megarl.models.builder import build_model_chunk
from megarl.models.family import FAMILIES
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout
from megarl.parallel.spawn import run_on_ranks


def convert_megatron_to_hf(
    ckpt_dir: str,
    out_dir: str,
    layout: ParallelLayout | None = None,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = 2 * 1024**3,
) -> dict:
    """Collective: load the checkpoint at TP=PP=1 (every DP rank a full copy; rank 0 writes). Returns the HF config."""
    layout = layout or ParallelLayout()
    if layout.tp != 1 or layout.pp != 1:
        raise ValueError("export loads full tensors: use a layout with tp=pp=1")
    meta = ckpt.read_meta(ckpt_dir)
    check_export_dir(out_dir, overwrite)
    hf_config = meta["hf_config"]
    spec = spec_from_hf_config(hf_config)
    init_distributed(layout)
    chunk = build_model_chunk(spec, layout, dtype=meta["dtype"], init_weights=False, device="cpu")
    load_model(ckpt_dir, chunk)
    if dist.get_rank() == 0:
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        state = chunk.state_dict()
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        for tmap in tqdm(tensor_maps(spec), desc="megatron -> hf"):
            for name, tensor in zip(tmap.hf, to_hf(tmap, state[tmap.megatron], spec)):
                writer.add(name, tensor)
        writer.close()
        architecture = FAMILIES[spec.family].hf_architecture
        if spec.score_head:  # a reward model: the classification class with its one label
            architecture = architecture.replace("ForCausalLM", "ForSequenceClassification")
        config = {**hf_config, "architectures": [architecture], "dtype": meta["dtype"]}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        copy_tokenizer_files(os.path.join(ckpt_dir, ckpt.TOKENIZER_DIR), tmp)
        ckpt.replace_dir(tmp, out_dir)
    dist.barrier()
    return hf_config


def export_on_a_rank(ckpt_dir: str, out_dir: str, overwrite: bool, max_shard_bytes: int) -> dict:
    """``convert_megatron_to_hf`` on one rank (in this process); the HF config."""
    export = functools.partial(convert_megatron_to_hf, overwrite=overwrite, max_shard_bytes=max_shard_bytes)
    return run_on_ranks(export, 1, ckpt_dir, out_dir)
