"""Reading and writing HuggingFace safetensors checkpoints one tensor at a time."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)


def _check_readable(path: str) -> list[str]:
    """The tensor names of a safetensors file; ValueError naming the file if it is missing, truncated or damaged
    (safetensors checks the header and that the file is as long as the header says)."""
    from safetensors import SafetensorError

    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing (named by {INDEX_FILE}); copy the complete model directory")
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise ValueError(
            f"{path} is not a readable safetensors file ({e}): it is truncated or damaged; download or export it again"
        ) from None


class HFWeights:
    """Lazy access to the tensors of a HF directory (single file or sharded with an index)."""

    def __init__(self, hf_dir: str):
        index = os.path.join(hf_dir, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._file_of = {name: os.path.join(hf_dir, fname) for name, fname in weight_map.items()}
            for path in sorted(set(self._file_of.values())):
                _check_readable(path)
        else:
            files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors weights in {hf_dir} (only safetensors checkpoints are read)")
            self._file_of = {}
            for fname in files:
                names = _check_readable(os.path.join(hf_dir, fname))
                self._file_of.update({name: os.path.join(hf_dir, fname) for name in names})

    @property
    def names(self) -> set[str]:
        return set(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self._file_of[name], framework="pt") as f:
            return f.get_tensor(name)

    def shape(self, name: str) -> list[int]:
        with safe_open(self._file_of[name], framework="pt") as f:
            return list(f.get_slice(name).get_shape())


class ShardedSafetensorsWriter:
    """Writes tensors into ``model-0000i-of-0000N.safetensors`` files of at most ``max_shard_bytes`` plus the index.

    Holds at most one shard in memory.
    """

    def __init__(self, out_dir: str, max_shard_bytes: int = 2 * 1024**3):
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self._total_bytes += nbytes

    def close(self) -> None:
        if self._pending:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(self.out_dir, f"shard-{i}.tmp"), os.path.join(self.out_dir, final))
            weight_map.update({name: final for name in names})
        with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}, f, indent=2)

    def _flush(self) -> None:
        save_file(
            self._pending, os.path.join(self.out_dir, f"shard-{len(self._shards)}.tmp"), metadata={"format": "pt"}
        )
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy the tokenizer (and generation config) files that exist in ``src_dir``; returns their names."""
    import shutil

    os.makedirs(dst_dir, exist_ok=True)
    copied = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src_dir, f))]
    for f in copied:
        shutil.copy2(os.path.join(src_dir, f), os.path.join(dst_dir, f))
    return copied
