"""Calling a reward function safely: a sample whose scoring raises (or returns something that is not a finite
number) scores 0 and is counted; the run goes on. Nothing here prints: the caller reports ``first_error`` once."""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field


@dataclass
class ScoreResult:
    """Scores of one batch, in sample order."""

    scores: list[float]
    """One finite score per sample; 0.0 where scoring failed."""
    extra: dict[str, list[float]] = field(default_factory=dict)
    """Extra numeric fields of dict results (logged as reward/<field> means), kept only when every sample of the
    batch has a finite value for them (a field missing on one sample, or any failed sample, drops it), so a mean is
    always over the whole batch."""
    errors: int = 0
    """Samples that scored 0.0 because scoring failed."""
    first_error: str | None = None
    """The first traceback (or the first bad value), for the caller to print once."""


def _as_float(value) -> float | None:
    """A finite float from a Python / NumPy number, a bool or a one-element tensor; None for anything else."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        return None
    try:
        number = float(value)
    except Exception:  # e.g. a tensor of several elements
        return None
    return number if math.isfinite(number) else None


def _as_score(value) -> tuple[float, dict[str, float]]:
    """(score, extra fields) of one result; ValueError if it is not a finite number or a dict with one."""
    extra = {}
    if isinstance(value, dict):
        for key, v in value.items():
            number = _as_float(v)
            if key != "score" and number is not None:
                extra[key] = number
        value = value.get("score")
    score = _as_float(value)
    if score is None:
        raise ValueError(f"a reward must be a finite number or a dict with a finite 'score', got {value!r:.200}")
    return score, extra


def _call(fn, prompts, responses, ground_truths, extras) -> list:
    out = list(fn(prompts, responses, ground_truths, extras))
    if len(out) != len(prompts):
        raise ValueError(f"the reward function returned {len(out)} values for {len(prompts)} samples")
    return out


def _call_one(fn, i, prompts, responses, ground_truths, extras) -> tuple[object, str | None]:
    """(value, None) or (None, traceback) for sample ``i`` scored alone (a batch of one)."""
    one = slice(i, i + 1)
    try:
        return _call(fn, prompts[one], responses[one], ground_truths[one], extras[one])[0], None
    except Exception:
        return None, traceback.format_exc()


def score_batch(fn, prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> ScoreResult:
    """Score the batch in one call. If that call raises or returns the wrong number of values, score each sample
    alone, so only the samples whose own call fails get 0 (and are counted). A value that is not a finite number (or
    a dict with a finite 'score') is an error too. Deterministic if ``fn`` is."""
    n = len(prompts)
    if not len(responses) == len(ground_truths) == len(extras) == n:
        raise ValueError(
            f"score_batch needs one of each per sample: {n} prompts, {len(responses)} responses, "
            f"{len(ground_truths)} ground truths, {len(extras)} extras"
        )
    try:
        outcomes = [(v, None) for v in _call(fn, prompts, responses, ground_truths, extras)] if n else []
    except Exception:
        outcomes = [_call_one(fn, i, prompts, responses, ground_truths, extras) for i in range(n)]
    result = ScoreResult(scores=[0.0] * n)
    extra_rows: list[dict[str, float]] = [{} for _ in range(n)]
    for i, (value, error) in enumerate(outcomes):
        if error is None:
            try:
                result.scores[i], extra_rows[i] = _as_score(value)
            except ValueError as e:
                error = f"sample {i}: {e}"
        if error is not None:
            result.errors += 1
            result.first_error = result.first_error or error
    keys = set.intersection(*(set(r) for r in extra_rows)) if extra_rows else set()
    result.extra = {k: [r[k] for r in extra_rows] for k in sorted(keys)}
    return result
