"""HF checkpoint -> megarl checkpoint (a Megatron distributed checkpoint), streamed tensor by tensor."""

from __future__ import annotations

import functools
import os
import shutil

import torch
import torch.distributed as dist
from tqdm import tqdm

from megarl.checkpoint import format as ckpt
from megarl.checkpoint.weights import save_model
from megarl.convert.checks import ConversionError, check_output_dir
from megarl.convert.hf_io import HFWeights, copy_tokenizer_files
from megarl.models.adapter import local_spec_names, tensor_maps, to_megatron
from megarl.models.builder import DTYPES, build_model_chunk
from megarl.models.spec import ModelSpec, read_hf_config, spec_from_hf_config
from megarl.parallel import megatron_shards as shards
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout
from megarl.parallel.spawn import run_on_ranks


def hf_dtype(hf_config: dict) -> str:
    name = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32").replace("torch.", "")
    if name not in DTYPES:
        raise ConversionError(f"HF dtype {name!r} is not supported (supported: {sorted(DTYPES)})")
    return name


def check_hf_source(hf_dir: str) -> tuple[dict, ModelSpec]:
    """Refuse unsupported architectures, missing tensors and a tokenizer larger than the vocabulary."""
    try:
        hf_config = read_hf_config(hf_dir)
        spec = spec_from_hf_config(hf_config)
        weights = HFWeights(hf_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ConversionError(str(e)) from None
    needed = {name for m in tensor_maps(spec) for name in m.hf}
    missing = sorted(needed - weights.names)
    if missing:
        raise ConversionError(
            f"{hf_dir} lacks {len(missing)} tensors the {spec.family} config implies, e.g. {missing[:3]}"
        )
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in needed and weights.shape(name)[0] != spec.vocab_size:
            raise ConversionError(
                f"{name} has {weights.shape(name)[0]} rows but config.json says vocab_size={spec.vocab_size}"
            )
    if os.path.isfile(os.path.join(hf_dir, "tokenizer_config.json")) or os.path.isfile(
        os.path.join(hf_dir, "tokenizer.json")
    ):
        from transformers import AutoTokenizer

        n_tokens = len(AutoTokenizer.from_pretrained(hf_dir))
        if n_tokens > spec.vocab_size:
            raise ConversionError(
                f"the tokenizer in {hf_dir} has {n_tokens} tokens but the model's vocab_size is {spec.vocab_size}: "
                "tokenizer and weights do not belong together"
            )
    return hf_config, spec


def load_hf_into_chunk(
    chunk, hf_dir: str, spec: ModelSpec, layout: ParallelLayout, rank: int, progress: bool, value_head: bool = False
) -> None:
    """Stream the HF tensors this rank needs into its Megatron chunk, one Megatron tensor at a time.

    ``value_head=True`` (a critic): the language-model head is not read and the value head keeps its init."""
    c = layout.coords(rank)
    stage = shards.StageInfo.at(layout, rank, spec)
    weights = HFWeights(hf_dir)
    params = local_spec_names(chunk.named_parameters())  # a Transformer Engine chunk's fused norms too
    assigned = set()
    maps = tensor_maps(spec)
    for tmap in tqdm(maps, desc="hf -> megatron", disable=not progress):
        if not shards.held_names(tmap.megatron, stage, tied_embeddings=spec.tie_word_embeddings):
            continue  # another stage's tensor: do not even read it
        full = to_megatron(tmap, [weights.get(n) for n in tmap.hf], spec)
        for lname, shard in shards.local_shards(
            tmap.megatron, full, stage, c.tp, layout.tp, tied_embeddings=spec.tie_word_embeddings,
            value_head=spec.score_head,
        ):
            if value_head and lname.startswith("output_layer."):
                continue  # the critic's head is a value head, not the language-model head
            with torch.no_grad():
                params[lname].copy_(shard)
            assigned.add(lname)
        del full
    unassigned = sorted(n for n in set(params) - assigned if not (value_head and n.startswith("output_layer.")))
    if unassigned:
        raise RuntimeError(f"rank {rank}: no HF tensor mapped to {unassigned}")


def convert_hf_to_megatron(
    hf_dir: str, out_dir: str, layout: ParallelLayout, *, dtype: str | None = None, overwrite: bool = False
) -> dict:
    """Collective over ``layout``'s ranks: write ``out_dir`` as a megarl checkpoint (iteration 0). Returns its meta.

    Written into ``<out_dir>.tmp`` and renamed at the end, so a failed run never leaves a valid-looking output.
    """
    hf_config, spec = check_hf_source(hf_dir)
    check_output_dir(out_dir, overwrite)
    dtype = dtype or hf_dtype(hf_config)
    init_distributed(layout)
    rank = dist.get_rank()
    tmp = out_dir.rstrip("/") + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    chunk = build_model_chunk(spec, layout, dtype=dtype, init_weights=False, device="cpu")
    load_hf_into_chunk(chunk, hf_dir, spec, layout, rank, progress=rank == 0)
    save_model(tmp, chunk, iteration=0)
    meta = {
        "family": spec.family,
        "hf_config": hf_config,
        "vocab_size": spec.vocab_size,
        "padded_vocab_size": spec.padded_vocab_size,
        "dtype": dtype,
        "written_with": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep},
        "source": os.path.abspath(hf_dir),
    }
    if rank == 0:
        copy_tokenizer_files(hf_dir, os.path.join(tmp, ckpt.TOKENIZER_DIR))
        ckpt.write_meta(tmp, meta)
        ckpt.replace_dir(tmp, out_dir)
    dist.barrier()
    return meta


def convert_on_ranks(hf_dir: str, out_dir: str, layout: ParallelLayout, dtype: str | None, overwrite: bool) -> dict:
    """``convert_hf_to_megatron`` on ``layout``'s ranks, started here (one rank: in this process); rank 0's meta."""
    convert = functools.partial(convert_hf_to_megatron, dtype=dtype, overwrite=overwrite)
    return run_on_ranks(convert, layout.world_size, hf_dir, out_dir, layout)
