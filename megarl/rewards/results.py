"""Scoring a batch with a reward function. Each sample's outcome is a finite score (plus extra numeric fields) or a
``Failure``; a failed sample scores 0 and is counted, and the run goes on.

``score_batch`` calls the function in this process (the built-in rule rewards). ``megarl.rewards.worker_pool`` calls a
user's function in worker processes and builds the same ``ScoreResult`` from the same outcomes (``outcome``,
``call``, ``assemble``). Nothing here prints: the caller reports ``first_error`` once."""

from __future__ import annotations

import math
import os
import sys
import traceback
from dataclasses import dataclass, field

ERROR, TIMEOUT, CANCELLED = "error", "timeout", "cancelled"
"""Kinds of failure: the call raised, returned a bad value or killed its worker; it ran out of time; or the run was
stopping (the sample is never trained on: its rollout is dropped, or its group generated again on resume)."""


class RewardFailure(RuntimeError):
    """Too many of a step's samples failed to score (``reward.stop_on_error_fraction``): every rank sees the same
    gathered scores and stops at once; the message holds the first failure."""


@dataclass(frozen=True)
class Failure:
    """Why one sample scored 0."""

    kind: str
    """ERROR, TIMEOUT or CANCELLED."""
    message: str
    """What happened, completing 'the sample of prompt ... ': 'raised:\\n<traceback>', 'timed out after 2 s ...'."""


Outcome = tuple[float, dict[str, float]] | Failure
"""One sample's (score, extra numeric fields), or why it failed."""


@dataclass
class ScoreResult:
    """Scores of one batch, in sample order."""

    scores: list[float]
    """One finite score per sample; 0.0 where scoring failed."""
    failed: list[str] = field(default_factory=list)
    """Per sample: '' (scored), ERROR, TIMEOUT or CANCELLED."""
    extra: dict[str, list[float]] = field(default_factory=dict)
    """Extra numeric fields of dict results (logged as reward/<field> means), kept only when every sample of the
    batch has a finite value for them (a field missing on one sample, or any failed sample, drops it), so a mean is
    always over the whole batch."""
    first_error: str | None = None
    """The first failure (in sample order), with its prompt, for the caller to print once."""

    @property
    def errors(self) -> int:
        """Samples that scored 0.0 because scoring failed (timeouts included)."""
        return sum(bool(kind) for kind in self.failed)

    @property
    def timeouts(self) -> int:
        """Samples that scored 0.0 because scoring them ran out of time."""
        return self.failed.count(TIMEOUT)


def _as_float(value) -> float | None:
    """A finite float from a Python / NumPy number, a bool or a one-element tensor; None for anything else."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        return None
    try:
        number = float(value)
    except Exception:  # e.g. a tensor of several elements
        return None
    return number if math.isfinite(number) else None


def outcome(value) -> Outcome:
    """A returned value as (score, extra fields), or a Failure if it is not a finite number or a dict with one."""
    extra = {}
    if isinstance(value, dict):
        for key, v in value.items():
            number = _as_float(v)
            if key != "score" and number is not None:
                extra[key] = number
        value = value.get("score")
    score = _as_float(value)
    if score is None:
        message = f"returned {value!r:.200}; a reward must be a finite number or a dict with a finite 'score'"
        return Failure(ERROR, message)
    return score, extra


def call(fn, *args) -> list:
    """``fn``'s values for the batch (``args``: one list per argument, one item per sample); ValueError unless there
    is exactly one per sample."""
    out = list(fn(*args))
    if len(out) != len(args[0]):
        raise ValueError(f"the reward function returned {len(out)} values for {len(args[0])} samples")
    return out


_CALLERS = {os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")}
"""megarl's frames above the reward function: left out of its tracebacks."""


def raised() -> Failure:
    """The exception being handled, as a sample's failure: its traceback from the reward function's frame down."""
    _, error, tb = sys.exc_info()
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in _CALLERS:
        tb = tb.tb_next
    return Failure(ERROR, "raised:\n" + "".join(traceback.format_exception(type(error), error, tb)).rstrip())


def check_inputs(prompts, responses, ground_truths, extras) -> None:
    n = len(prompts)
    if not len(responses) == len(ground_truths) == len(extras) == n:
        raise ValueError(
            f"scoring needs one of each per sample: {n} prompts, {len(responses)} responses, "
            f"{len(ground_truths)} ground truths, {len(extras)} extras"
        )


def assemble(outcomes: list[Outcome], prompts: list[str]) -> ScoreResult:
    """The ScoreResult of per-sample outcomes."""
    result = ScoreResult(scores=[0.0] * len(outcomes), failed=[""] * len(outcomes))
    extra_rows: list[dict[str, float]] = [{} for _ in outcomes]
    for i, got in enumerate(outcomes):
        if isinstance(got, Failure):
            result.failed[i] = got.kind
            if result.first_error is None:
                result.first_error = f"the sample of prompt {prompts[i][:200]!r} {got.message}"
        else:
            result.scores[i], extra_rows[i] = got
    keys = set.intersection(*(set(r) for r in extra_rows)) if extra_rows else set()
    result.extra = {k: [r[k] for r in extra_rows] for k in sorted(keys)}
    return result


def merge(parts: list[ScoreResult]) -> ScoreResult:
    """Consecutive parts of a batch (in sample order) as one result: an extra field is kept if every part kept it
    (parts without samples aside); the first failure is the first part's that has one."""
    parts = [p for p in parts if p.scores]
    keys = set.intersection(*(set(p.extra) for p in parts)) if parts else set()
    return ScoreResult(
        scores=[s for p in parts for s in p.scores],
        failed=[f for p in parts for f in p.failed],
        extra={k: [v for p in parts for v in p.extra[k]] for k in sorted(keys)},
        first_error=next((p.first_error for p in parts if p.first_error), None),
    )


def _one(fn, i, prompts, responses, ground_truths, extras) -> Outcome:
    """Sample ``i`` scored alone (a batch of one)."""
    one = slice(i, i + 1)
    try:
        return outcome(call(fn, prompts[one], responses[one], ground_truths[one], extras[one])[0])
    except (Exception, SystemExit):
        return raised()


def score_batch(fn, prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> ScoreResult:
    """Score the batch in this process, in one call. If that call raises (``sys.exit`` included) or returns the wrong
    number of values, score each sample alone, so only the samples whose own call fails get 0 (and are counted). A
    value that is not a finite number (or a dict with a finite 'score') fails too. Deterministic if ``fn`` is.
    No timeout and no isolation: a hang or a crash in ``fn`` is the trainer's (``RewardPool`` has both)."""
    check_inputs(prompts, responses, ground_truths, extras)
    args = (prompts, responses, ground_truths, extras)
    try:
        outcomes = [outcome(v) for v in call(fn, *args)] if prompts else []
    except (Exception, SystemExit):
        outcomes = None  # re-scored below, outside this handler (its traceback is no sample's)
    if outcomes is None:
        outcomes = [_one(fn, i, *args) for i in range(len(prompts))]
    return assemble(outcomes, prompts)
