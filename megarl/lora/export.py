"""A LoRA training checkpoint out to HF land: its adapters as a PEFT directory (``--lora``), or the base with the
adapters merged in as a HF model (``--merge``: W + (alpha/rank) B A computed by peft into a fresh copy of the base)."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from megarl.checkpoint.format import CheckpointError, latest_iteration_dir, read_meta
from megarl.config.schema import LoraConfig
from megarl.lora.checkpoint import KEY_PREFIX
from megarl.lora.peft_io import write_peft_adapter


def checkpoint_lora(meta: dict) -> LoraConfig | None:
    """The ``actor.lora`` a training checkpoint (its ``read_meta``) was written with (None: a whole model)."""
    return LoraConfig(**meta["lora"]) if meta.get("lora") else None


def read_checkpoint_adapters(root: str) -> dict[str, torch.Tensor]:
    """The full PEFT-named adapters of the ``latest`` iteration, read with torch's checkpoint reader (no process
    group, no model)."""
    import torch.distributed.checkpoint as dcp

    path = latest_iteration_dir(root)
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if k.startswith(KEY_PREFIX)}
    if not state:
        raise CheckpointError(f"{path} holds no LoRA adapters")
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return {k.removeprefix(KEY_PREFIX): v for k, v in sorted(state.items())}


def export_adapter(root: str, out: str) -> None:
    """``megarl convert megatron-to-hf --lora``: the checkpoint's adapters as a PEFT directory."""
    meta = read_meta(root)
    lora = checkpoint_lora(meta)
    if lora is None:
        raise CheckpointError(f"{root} is a whole model, not LoRA adapters: export it without --lora")
    write_peft_adapter(out, read_checkpoint_adapters(root), lora, meta.get("source", ""))


def export_merged(root: str, out: str) -> None:
    """``megarl convert megatron-to-hf --merge``: a HF model of the base with the adapters merged in (peft's
    ``merge_and_unload`` on a copy loaded from the base's HF directory)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.convert.hf_io import copy_tokenizer_files  # here: convert imports lora (its export command)

    meta = read_meta(root)
    base = meta.get("source", "")
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise CheckpointError(
            f"--merge reads the base from its HF directory, and {root}'s base {base!r} is not one; export the base to "
            "HF first, or use --lora"
        )
    tmp = tempfile.mkdtemp(prefix="megarl-adapter-")
    try:
        export_adapter(root, tmp)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, meta["dtype"]))
        merged = PeftModel.from_pretrained(model, tmp).merge_and_unload()
        merged.save_pretrained(out)
        copy_tokenizer_files(base, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
