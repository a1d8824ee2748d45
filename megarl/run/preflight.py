"""Pre-launch checks: every check that needs no process, before anything starts: the config against itself and the
model (``megarl.config.validate``), and the inputs a run reads (the reward function, loaded as the run will load it,
and the data files). Above the reward and data packages, which the config's own validation cannot import."""

from __future__ import annotations

import os

from megarl.config.loader import ConfigError
from megarl.config.schema import MegarlConfig
from megarl.config.validate import validate
from megarl.data import DataError, check_files
from megarl.env.workers import check_environment
from megarl.rewards import RewardLoadError
from megarl.rewards.scorer import check_loads
from megarl.rewards.worker_pool import RewardWorkerError


def not_mounted_here(path: str) -> bool:
    """An absolute path whose top-level directory this host lacks (a cluster's /data or /models): the launch host
    cannot see it, the nodes may."""
    parts = os.path.abspath(path).split(os.sep)
    return os.path.isabs(path) and len(parts) > 2 and not os.path.isdir(os.sep + parts[1])


def _reward_file(spec: str) -> str | None:
    where = spec.rpartition(":")[0]
    return where if where.endswith(".py") else None


def check_inputs(cfg: MegarlConfig, skip: frozenset[str] = frozenset()) -> None:
    """The reward function and the data files, checked before any process starts (ConfigError names the fix).
    ``skip``: paths not to look at (the launch host cannot see them)."""
    if _reward_file(cfg.reward.function) not in skip:
        try:
            check_loads(cfg.reward)
        except (RewardLoadError, RewardWorkerError) as e:
            raise ConfigError(f"reward.function: {e}") from None
    if cfg.env.enabled:
        try:
            check_environment(cfg.env)
        except (RewardLoadError, RewardWorkerError) as e:
            raise ConfigError(f"env: {e}") from None
    d = cfg.data
    if not d.train_files:
        raise ConfigError("data.train_files: no training data; set data.train_files=[path.jsonl] (or builtin:digits)")
    train_files = [p for p in d.train_files if p not in skip]
    val_files = [p for p in d.val_files if p not in skip]
    try:
        train = check_files(train_files, d.prompt_key, d.answer_key, "train", d.check)
        val = check_files(val_files, d.prompt_key, d.answer_key, "val", d.check)
    except DataError as e:
        raise ConfigError(f"data: {e}") from None
    if train is not None and train_files == d.train_files and d.train_batch_size > train:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} exceeds the {train} records of data.train_files; lower it "
            "or add prompts"
        )
    if val is not None and val_files and val_files == d.val_files and d.val_batch_size > val:
        raise ConfigError(
            f"data.val_batch_size={d.val_batch_size} exceeds the {val} records of data.val_files; lower it (0 = all "
            "of them)"
        )


def preflight(cfg: MegarlConfig, world_size: int | None = None, *, strict_paths: bool = True) -> list[str]:
    """Every check that needs no process: the config against itself and the model (``validate``), the reward and
    the data (``check_inputs``). ConfigError on the first problem. With ``strict_paths=False`` (a launch host), a
    path this host cannot see (``not_mounted_here``) is a warning, returned, instead of an error."""
    paths = [cfg.model.path, *cfg.data.train_files, *cfg.data.val_files, _reward_file(cfg.reward.function)]
    unseen = frozenset() if strict_paths else frozenset(p for p in paths if p and not_mounted_here(p))
    warnings = [
        f"{p} is not visible on this host (no /{os.path.abspath(p).split(os.sep)[1]} here): not checked; the nodes "
        "must see it (--strict-paths makes this an error)"
        for p in sorted(unseen)
    ]
    if cfg.model.path not in unseen:
        validate(cfg, world_size=world_size)
    check_inputs(cfg, skip=unseen)
    return warnings
