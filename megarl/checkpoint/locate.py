"""Where a run's training checkpoints are (``megarl.checkpoint.training`` writes and reads them): their names, the
complete ones (a complete manifest), the one a run resumes from, and the set-aside of later ones after a roll-back.
No torch: ``megarl train`` checks its resume target with this module before any process starts."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from megarl.checkpoint import format as ckpt
from megarl.checkpoint.manifest import ManifestError, read_manifest

CHECKPOINTS = "checkpoints"
CRITIC_DIR = "critic"
"""The critic's own distributed checkpoint inside ``iter_N`` (written by a critic pool)."""
TRAINER_STATE = "trainer_state.json"
ROLLOUT_BATCH = "rollout_batch.pt"
"""One-step-off: the batch generated for the next step when the checkpoint was saved (``{"step", "batch"}``)."""
ROLLOUT_STREAM = "rollout_stream.pt"
"""Bounded: the rollout pool's stream when the checkpoint was saved (``megarl.rl.bounded.RolloutServer``)."""
_ITER = re.compile(r"^iter_(\d{7})$")


@dataclass
class Found:
    """The checkpoint a run resumes from."""

    path: str
    step: int
    skipped: list[str]
    """Newer ``iter_N`` directories passed over (no complete manifest), with the reason."""


def checkpoints_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS)


def complete_iterations(root: str) -> tuple[list[tuple[int, str]], list[str]]:
    """(step, path) of every ``iter_N`` under ``root`` whose manifest is complete, newest first, and a note per
    ``iter_N`` passed over. ``iter_N.tmp`` directories (interrupted saves) are never candidates."""
    found, skipped = [], []
    if not os.path.isdir(root):
        return found, skipped
    for name in sorted(os.listdir(root), reverse=True):
        m = _ITER.match(name)
        if not m:
            continue
        path = os.path.join(root, name)
        try:
            read_manifest(path)
        except ManifestError as e:
            skipped.append(str(e))
            continue
        found.append((int(m.group(1)), path))
    return found, skipped


def find_resume(output_dir: str) -> Found | None:
    """The newest complete checkpoint under ``output_dir`` (``resume=auto``), or None."""
    found, skipped = complete_iterations(checkpoints_root(output_dir))
    return Found(found[0][1], found[0][0], skipped) if found else None


def resolve_path(path: str) -> Found:
    """``resume=<path>``: an ``iter_N`` directory, or a checkpoints root (its newest complete iteration)."""
    name = os.path.basename(os.path.normpath(path))
    if _ITER.match(name):
        read_manifest(path)  # ManifestError names the missing/damaged manifest
        return Found(path, int(name[5:]), [])
    found, skipped = complete_iterations(path)
    if not found:
        raise ckpt.CheckpointError(
            f"trainer.resume={path}: no complete iter_N checkpoint there"
            + (f" ({'; '.join(skipped)})" if skipped else "")
            + "; name an iter_N directory or a run's checkpoints directory"
        )
    return Found(found[0][1], found[0][0], skipped)


ABANDONED_DIR = "abandoned"
"""Under a checkpoints root: the checkpoints after the one a run rolled back to (``abandon_later``)."""


def abandon_later(root: str, step: int) -> list[str]:
    """A run resumed from ``iter_<step>`` of ``root`` (rolled back): move every later ``iter_N`` to
    ``root/abandoned/`` so that pruning and ``resume=auto`` follow the new branch, and point ``latest`` at
    ``iter_<step>``. (Interrupted saves, ``iter_N.tmp``, are removed as always.) Returns the moved ones' new paths."""
    later = sorted(n for n in os.listdir(root) if (m := _ITER.match(n)) and int(m.group(1)) > step)
    moved = []
    for name in later:
        target = os.path.join(root, ABANDONED_DIR, name)
        suffix = 1
        while os.path.exists(target):  # abandoned twice: keep both
            target = os.path.join(root, ABANDONED_DIR, f"{name}.{suffix}")
            suffix += 1
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(os.path.join(root, name), target)
        moved.append(target)
    if moved:
        ckpt.atomic_write(os.path.join(root, ckpt.LATEST_FILE), ckpt.iter_dirname(step) + "\n")
    return moved


def read_trainer_state(path: str) -> dict:
    with open(os.path.join(path, TRAINER_STATE)) as f:
        return json.load(f)
