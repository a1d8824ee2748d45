"""megarl's one checkpoint format: ``<root>/iter_NNNNNNN/`` (a Megatron distributed checkpoint, TP/PP-independent),
``<root>/latest`` (the iteration to load) and ``<root>/megarl_checkpoint.json`` (plain-typed metadata: format
version, model family, HF config, true and padded vocabulary, the layout it was written with).

Saving is atomic per iteration: all ranks write into ``iter_N.tmp/``, then rank 0 renames it and replaces ``latest``
last. A directory that ``latest`` does not name is never loaded (dist_checkpointing itself writes in place).

This module reads and writes names and metadata only (no torch: the config checks read checkpoints through it);
``megarl.checkpoint.weights`` saves and loads the weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil

FORMAT_VERSION = 1
META_FILE = "megarl_checkpoint.json"
LATEST_FILE = "latest"
TOKENIZER_DIR = "tokenizer"


class CheckpointError(RuntimeError):
    """The directory is not a complete megarl checkpoint (or is one where none may be written)."""


def iter_dirname(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def holds_checkpoint(root: str) -> bool:
    return os.path.isfile(os.path.join(root, META_FILE)) or os.path.isfile(os.path.join(root, LATEST_FILE))


def read_meta(root: str) -> dict:
    path = os.path.join(root, META_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{root} is not a megarl checkpoint (no {META_FILE})")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {meta.get('format_version')} (this megarl reads {FORMAT_VERSION})"
        )
    return meta


def write_meta(root: str, meta: dict) -> None:
    """Rank 0 only. Plain types only (dist_checkpointing's common.pt is read with weights_only=True)."""
    atomic_write(os.path.join(root, META_FILE), json.dumps({"format_version": FORMAT_VERSION, **meta}, indent=2))


def latest_iteration_dir(root: str) -> str:
    """The complete iteration directory that ``latest`` names (a damaged ``latest`` is refused, naming it)."""
    latest = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(latest):
        raise CheckpointError(f"{root} has no '{LATEST_FILE}' file: not a complete megarl checkpoint")
    with open(latest, "rb") as f:
        raw = f.read(256)
    name = raw.decode("utf-8", "replace").strip()
    path = os.path.join(root, name)
    if not re.fullmatch(r"iter_\d{7}", name) or not os.path.isfile(os.path.join(path, "metadata.json")):
        present = sorted(d for d in os.listdir(root) if re.fullmatch(r"iter_\d{7}", d))
        raise CheckpointError(
            f"{latest} is damaged: it holds {raw[:40]!r}, which names no complete iter_N directory. "
            f"Write the name of the iteration to load into it (present here: {present or 'none'})"
        )
    return path


def replace_dir(src: str, dst: str) -> None:
    """Move a finished ``src`` into place as ``dst`` (replacing an old ``dst``) with renames only, so ``dst`` is
    never a half-written directory."""
    old = dst.rstrip("/") + ".old"
    if os.path.exists(dst):
        os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
