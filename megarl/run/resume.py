"""Where a run starts: ``trainer.resume`` (auto / never / a path) against what ``trainer.output_dir`` holds.

``plan_start`` is pure (no process group): the CLI calls it once before any process starts, so a bad resume target,
a checkpoint of another model or an unwritable ``output_dir`` fails with one message; every rank calls it again at
start and gets the same answer. Nothing here deletes anything except ``clear_previous_run`` (resume=never with
trainer.overwrite=true).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from megarl.checkpoint import format as ckpt
from megarl.checkpoint.locate import (
    CHECKPOINTS,
    TRAINER_STATE,
    Found,
    checkpoints_root,
    complete_iterations,
    find_resume,
    read_trainer_state,
    resolve_path,
)
from megarl.checkpoint.manifest import ManifestError
from megarl.config.schema import MegarlConfig
from megarl.logging.jsonl import SAMPLES_DIR, TIMELINE_FILE, read_metrics
from megarl.models.spec import ModelSpec, spec_from_hf_config

METRICS_FILE = "metrics.jsonl"
STOPPED_FILE = "STOPPED"
"""Written by rank 0 when a signal stopped the run after saving (its content says the step and the signal)."""
EXIT_PREEMPTED = 75
"""``megarl train``'s exit status after a SIGTERM/SIGUSR1 stop with a saved checkpoint (EX_TEMPFAIL): requeue."""

_MODEL_FIELDS = ("family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
                 "vocab_size", "tie_word_embeddings")  # fmt: skip


class ResumeError(ValueError):
    """The run cannot start from what output_dir / trainer.resume name; the message says the fix."""


class RunComplete(ResumeError):
    """``trainer.resume=auto`` found the run already at trainer.total_steps: nothing to do, and not a failure (exit
    0: a SLURM job requeued after its last save ends as completed)."""


SLURM_LOG_DIR = "slurm"
"""``megarl launch slurm``'s default log folder inside output_dir: the live job writes it, nothing moves it."""
SET_ASIDE_PREFIX = "set-aside-"
"""Where a run that never completed a step is moved when ``resume=auto`` starts over: ``set-aside-<UTC time>/``."""


def completed_steps(out: str) -> list[int]:
    """The steps ``metrics.jsonl`` records as completed (empty when it is absent or empty; a last line cut by a kill
    is not one; nor is step 0, the validation before training)."""
    path = os.path.join(out, METRICS_FILE)
    return [int(r["step"]) for r in read_metrics(path) if int(r["step"]) > 0] if os.path.isfile(path) else []


RUN_ENTRIES = (METRICS_FILE, TIMELINE_FILE, STOPPED_FILE, "reward_curve.png", "config.yaml", "placement.json",
               "engine", "wandb", SAMPLES_DIR, CHECKPOINTS)  # fmt: skip
"""What a run writes in ``output_dir`` (beside the SLURM log folder, set-aside folders and ``.megarl-*`` files)."""


def _kept_in_place(name: str) -> bool:
    return name == SLURM_LOG_DIR or name.startswith((SET_ASIDE_PREFIX, ".megarl-"))


def _run_entry(name: str) -> bool:
    """A run's own file, or one it was writing when killed (``atomic_write``'s ``NAME.tmp``)."""
    return name in RUN_ENTRIES or name.removesuffix(".tmp") in RUN_ENTRIES


def foreign_entries(out: str) -> list[str]:
    """The names in ``out`` that no megarl run wrote (sorted)."""
    names = os.listdir(out) if os.path.isdir(out) else []
    return sorted(n for n in names if not _run_entry(n) and not _kept_in_place(n))


def set_aside_previous_run(out: str) -> str:
    """Move the run's own files in ``out`` (``RUN_ENTRIES``) into a new ``set-aside-<UTC time>`` folder in it;
    returns that folder. Nothing else is touched (``plan_start`` refuses an ``out`` that holds anything else)."""
    aside = os.path.join(out, SET_ASIDE_PREFIX + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    os.makedirs(aside)
    for name in os.listdir(out):
        if _run_entry(name):
            shutil.move(os.path.join(out, name), os.path.join(aside, name))
    return aside


def _check_writable(out: str) -> None:
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".megarl-write-test-"):
            pass
    except OSError as e:
        raise ResumeError(
            f"trainer.output_dir={out} is not writable ({e.strerror or e}); choose a directory you can write"
        ) from None


def holds_previous_run(out: str) -> bool:
    root = checkpoints_root(out)
    has_iters = os.path.isdir(root) and any(n.startswith("iter_") for n in os.listdir(root))
    return os.path.isfile(os.path.join(out, METRICS_FILE)) or has_iters


def _check_same_model(found: Found, spec: ModelSpec) -> None:
    root = os.path.dirname(found.path)
    try:
        meta = ckpt.read_meta(root)
    except ckpt.CheckpointError as e:
        raise ResumeError(f"cannot resume from {found.path}: {e}") from None
    theirs = spec_from_hf_config(meta["hf_config"])
    diff = [f"{f} {getattr(theirs, f)} (checkpoint) vs {getattr(spec, f)} (model.path)" for f in _MODEL_FIELDS
            if getattr(theirs, f) != getattr(spec, f)]  # fmt: skip
    if diff:
        raise ResumeError(
            f"{found.path} holds a different model than model.path: {'; '.join(diff)}. Resume with the model it was "
            "trained from, or start fresh (trainer.resume=never with another trainer.output_dir)"
        )


def plan_start(cfg: MegarlConfig, spec: ModelSpec) -> Found | None:
    """The checkpoint to resume from, or None for a fresh start; ResumeError says why neither is possible."""
    t = cfg.trainer
    out = t.output_dir
    _check_writable(out)
    if t.resume == "never":
        if holds_previous_run(out) and not t.overwrite:
            raise ResumeError(
                f"trainer.output_dir={out} holds a previous run and trainer.resume=never: set trainer.overwrite=true "
                "to delete it, trainer.resume=auto to continue it, or choose another trainer.output_dir"
            )
        return None
    if t.resume == "auto":
        found = find_resume(out)
        if found is None:
            steps = completed_steps(out)
            if steps and max(steps) >= t.total_steps:  # trainer.save_every=0 leaves no checkpoint at the end
                raise RunComplete(
                    f"trainer.output_dir={out} holds a run that completed its step {max(steps)} = trainer.total_steps: "
                    "the run is complete, nothing to do"
                )
            foreign = foreign_entries(out) if holds_previous_run(out) and not steps else []
            if foreign:  # the run that never completed a step would be set aside: only megarl's own files move
                shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
                raise ResumeError(
                    f"trainer.output_dir={out} holds a run that never completed a step, to be set aside, and also "
                    f"files megarl did not write ({shown}): nothing was moved; move them out of it or choose another "
                    "trainer.output_dir"
                )
            if holds_previous_run(out) and steps:  # a run that never completed a step starts over (set aside)
                _, skipped = complete_iterations(checkpoints_root(out))
                raise ResumeError(
                    f"trainer.output_dir={out} holds a previous run that completed step {max(steps)} but no complete "
                    "checkpoint to continue from"
                    + (f" ({'; '.join(skipped)})" if skipped else "")
                    + ": set trainer.resume=never trainer.overwrite=true to start over there, or choose another "
                    "trainer.output_dir"
                )
            return None
    else:
        try:
            found = resolve_path(t.resume)
        except (ManifestError, ckpt.CheckpointError) as e:
            raise ResumeError(f"trainer.resume: {e}") from None
    _check_same_model(found, spec)
    if found.step == t.total_steps and validation_pending(found.path):  # stopped in the last step's validation
        return found
    if found.step >= t.total_steps and t.resume == "auto":
        raise RunComplete(
            f"{found.path} is at step {found.step} and trainer.total_steps={t.total_steps}: the run is complete, "
            "nothing to do (raise trainer.total_steps to continue training)"
        )
    if found.step >= t.total_steps:
        raise ResumeError(
            f"{found.path} is at step {found.step}, and trainer.total_steps={t.total_steps}: nothing left to run "
            "(raise trainer.total_steps to continue training)"
        )
    return found


def validation_pending(path: str) -> bool:
    """Whether checkpoint ``path`` was saved by a stop during its step's validation (its metrics wait for it)."""
    if not os.path.isfile(os.path.join(path, TRAINER_STATE)):  # a model-only checkpoint (converted)
        return False
    return read_trainer_state(path)["state"].get("pending_metrics") is not None


def clear_previous_run(out: str) -> None:
    """resume=never with overwrite: delete the previous run's metrics, checkpoints, W&B files and plots."""
    for name in (METRICS_FILE, TIMELINE_FILE, STOPPED_FILE, "reward_curve.png", "config.yaml"):
        if os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    for name in (os.path.basename(checkpoints_root(out)), "wandb", SAMPLES_DIR):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
