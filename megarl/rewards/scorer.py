"""Which path a reward takes, and when its failures stop the run.

The built-in rule rewards (``toy_digits``, ``gsm8k``, ``gsm8k_flexible``, ``math``) are pure and bounded (Math-Verify
has its own timeouts), so they run in the trainer's process and cost nothing extra. A user's function
(``path/to/file.py:fn``, ``package.module:fn``) runs in a ``RewardPool`` of worker processes, unless
``reward.num_workers=0`` puts it in the trainer's process (for a debugger; no timeout, no isolation)."""

from __future__ import annotations

from megarl.config.schema import RewardConfig
from megarl.rewards.registry import BUILTIN_REWARDS, load_reward_fn
from megarl.rewards.results import RewardFailure, ScoreResult, score_batch
from megarl.rewards.worker_pool import RewardPool, WorkerLimits, default_num_workers


class _ScoredWhenSubmitted:
    """``submit``/``finish`` (``RewardPool``'s) for scorers in this process: a part is scored when submitted."""

    _parts: list[ScoreResult] | None = None

    def submit(self, prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict], *,
               calls: int = 1) -> None:  # fmt: skip
        self._parts = [*(self._parts or []), self.score(prompts, responses, ground_truths, extras)]

    def finish(self) -> list[ScoreResult]:
        parts, self._parts = self._parts or [], None
        return parts


class InProcess(_ScoredWhenSubmitted):
    """A reward function called in this process; the same interface as ``RewardPool``."""

    def __init__(self, spec: str):
        self.spec = spec
        self.fn = load_reward_fn(spec)

    def describe(self) -> str:
        return f"{self.spec} in the trainer's process"

    def score(self, prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> ScoreResult:
        return score_batch(self.fn, prompts, responses, ground_truths, extras)

    def close(self) -> None:
        pass

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc) -> bool:
        return False


class NoFunction(_ScoredWhenSubmitted):
    """No reward function (a reward model alone): the function's part of every sample is 0, never a failure."""

    def describe(self) -> str:
        return "no reward function"

    def score(self, prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> ScoreResult:
        return ScoreResult([0.0] * len(prompts), [""] * len(prompts))

    def close(self) -> None:
        pass

    def __enter__(self) -> NoFunction:
        return self

    def __exit__(self, *exc) -> bool:
        return False


def in_workers(cfg: RewardConfig) -> bool:
    """Whether ``cfg.function`` runs in worker processes."""
    return bool(cfg.function) and cfg.function not in BUILTIN_REWARDS and cfg.num_workers != 0


def open_rewards(cfg: RewardConfig, *, budget_s: float | None = None) -> InProcess | RewardPool | NoFunction:
    """The reward ready to score (RewardLoadError if it does not load); close it when done. ``budget_s``: how long
    one batch may take on this rank (other ranks wait in a collective meanwhile)."""
    if not cfg.function:
        return NoFunction()
    if not in_workers(cfg):
        return InProcess(cfg.function)
    workers = default_num_workers() if cfg.num_workers is None else cfg.num_workers
    return RewardPool(cfg.function, num_workers=workers, timeout_s=cfg.timeout_s, budget_s=budget_s,
                      limits=WorkerLimits.of(cfg))


def check_loads(cfg: RewardConfig) -> None:
    """Load the reward the way the run will (a user's function in one worker process: an import that hangs, exits
    or crashes cannot take this process with it); RewardLoadError or RewardWorkerError says why it does not."""
    if not cfg.function:
        return
    if in_workers(cfg):
        RewardPool(cfg.function, num_workers=1, timeout_s=cfg.timeout_s, limits=WorkerLimits.of(cfg)).close()
    else:
        load_reward_fn(cfg.function)


def stop_if_broken(cfg: RewardConfig, failed: int, total: int, first_error: str | None, where: str) -> None:
    """RewardFailure (the run stops) when ``failed`` of ``total`` samples reach ``reward.stop_on_error_fraction``."""
    limit = cfg.stop_on_error_fraction
    if limit is None or not total or failed / total < limit:
        return
    raise RewardFailure(
        f"the reward function failed on {failed} of {total} samples {where} (reward.stop_on_error_fraction={limit:g}); "
        f"stopping the run. Fix the reward function (reward.stop_on_error_fraction=null trains on regardless). "
        f"The first failure: {first_error}"
    )
