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
_PENDING = re.compile(r"^iter_(\d{7})\.tmp$")
REPLACED_SUFFIX = ".tmp-replaced"
"""``iter_N`` set aside while its re-save is renamed in (``training._publish``), deleted right after."""
DAMAGED_DIR = "damaged"
"""Under a checkpoints root: checkpoints whose files disagree with their manifest, kept for a look (``set_aside``)."""


@dataclass
class Found:
    """The checkpoint a run resumes from."""

    path: str
    step: int
    skipped: list[str]
    """Newer ``iter_N`` directories passed over (no complete manifest), with the reason."""


def checkpoints_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS)


def _complete(path: str) -> str | None:
    """None if ``path`` has a complete manifest, else why not."""
    try:
        read_manifest(path)
        return None
    except ManifestError as e:
        return str(e)


def complete_iterations(root: str) -> tuple[list[tuple[int, str]], list[str]]:
    """(step, path) of every checkpoint under ``root`` whose manifest is complete, newest first, and a note per
    ``iter_N`` passed over. A complete ``iter_N.tmp`` counts where ``iter_N`` is absent: a save that a kill cut after
    its manifest, between the renames that publish it (``finish_interrupted_saves`` completes it); other
    ``iter_N.tmp*`` directories (interrupted saves) are never candidates."""
    found, skipped = [], []
    if not os.path.isdir(root):
        return found, skipped
    names = set(os.listdir(root))
    for name in sorted(names, reverse=True):
        m = _ITER.match(name) or _PENDING.match(name)
        if not m or (name.endswith(".tmp") and name[: -len(".tmp")] in names):
            continue
        path = os.path.join(root, name)
        why = _complete(path)
        if why is None:
            found.append((int(m.group(1)), path))
        elif not name.endswith(".tmp"):
            skipped.append(why)
    return found, skipped


def finish_interrupted_saves(root: str) -> list[str]:
    """The launch's leader, before anything reads the checkpoints: publish each complete ``iter_N.tmp`` whose
    ``iter_N`` is absent (the kill came between its renames), restore an ``iter_N`` set aside for a re-save that never
    arrived, and point ``latest`` at the newest complete checkpoint (a kill may have come before ``latest`` was
    written). The rest of ``iter_N.tmp*`` (saves cut before
    their manifest, a finished re-save's leftovers) is left for the start-up's tidy-up. Returns what it did."""
    if not os.path.isdir(root):
        return []
    done = []
    for name in sorted(os.listdir(root)):
        final = os.path.join(root, name.split(".", 1)[0])
        path = os.path.join(root, name)
        if os.path.exists(final) or not (_PENDING.match(name) or name.endswith(REPLACED_SUFFIX)):
            continue
        if _complete(path) is None:  # a finished save (or the one it was to replace): it becomes iter_N again
            os.rename(path, final)
            fsync_path(root)
            done.append(f"finished an interrupted save: {path} -> {os.path.basename(final)}")
    point_latest(root)
    return done


def point_latest(root: str) -> None:
    """``latest`` names the newest complete checkpoint (written only where it names another)."""
    found, _ = complete_iterations(root)
    if not found:
        return
    path, name = os.path.join(root, ckpt.LATEST_FILE), os.path.basename(found[0][1])
    try:
        with open(path) as f:
            if f.read().strip() == name:
                return
    except OSError:
        pass
    ckpt.atomic_write(path, name + "\n")


def set_aside(root: str, path: str, kind: str) -> str:
    """Move checkpoint ``path`` into ``root/<kind>/`` (``ABANDONED_DIR``, ``DAMAGED_DIR``), keeping an earlier one of
    the same name; returns its new path."""
    target = os.path.join(root, kind, os.path.basename(path))
    suffix = 1
    while os.path.exists(target):
        target = os.path.join(root, kind, f"{os.path.basename(path)}.{suffix}")
        suffix += 1
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.rename(path, target)
    return target


def fsync_path(path: str) -> None:
    """Make a file's contents, or a directory's entries (renames, new files), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    moved = [set_aside(root, os.path.join(root, name), ABANDONED_DIR) for name in later]  # abandoned twice: both kept
    if moved:
        ckpt.atomic_write(os.path.join(root, ckpt.LATEST_FILE), ckpt.iter_dirname(step) + "\n")
    return moved


def read_trainer_state(path: str) -> dict:
    with open(os.path.join(path, TRAINER_STATE)) as f:
        return json.load(f)
