"""Prompt datasets shipped with megarl, named ``builtin:NAME`` in ``data.train_files`` / ``data.val_files``.

They are generated from a fixed seed (no downloads), so every machine sees the same prompts.
"""

from __future__ import annotations

import random


def _digits(split: str) -> list[dict]:
    """The quickstart's verifiable toy task: copy the digit named in the prompt ("copy 7:" -> "7").

    Scored by ``megarl.rewards.toy.toy_digits`` (partial credit for answering with digits at all), so a tiny random
    model has a dense, learnable signal."""
    rng = random.Random({"train": 0, "val": 1}[split])
    verbs = ("copy", "echo", "say", "repeat")
    records = []
    for _ in range({"train": 2048, "val": 64}[split]):
        digit = str(rng.randrange(10))
        records.append({"prompt": f"{rng.choice(verbs)} {digit}:", "answer": digit})
    return records


BUILTIN_DATASETS = {"digits": _digits}
"""name -> records(split) for split in {'train', 'val'}."""

PREFIX = "builtin:"


def builtin_records(spec: str, split: str) -> list[dict]:
    """Records of ``builtin:NAME`` (``split`` is 'train' or 'val'); ValueError naming the choices otherwise."""
    name = spec[len(PREFIX) :] if spec.startswith(PREFIX) else spec
    if name not in BUILTIN_DATASETS:
        raise ValueError(f"unknown built-in dataset {spec!r}; choose one of {[PREFIX + n for n in BUILTIN_DATASETS]}")
    return BUILTIN_DATASETS[name](split)
