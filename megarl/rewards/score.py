"""Calling a reward function safely: a sample whose scoring raises (or returns something that is not a finite
number) scores 0 and is counted; the run goes on."""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field


@dataclass
class ScoreResult:
    scores: list[float]
    extra: dict[str, list[float]] = field(default_factory=dict)
    """Extra numeric fields of dict results, kept only when every sample has them."""
    errors: int = 0
    first_error: str | None = None
    """The first traceback or problem, for the caller to print once."""


def _as_score(value) -> tuple[float, dict]:
    """(score, extra fields) of one result; ValueError if it is not a finite number or a dict with one."""
    extra = {}
    if isinstance(value, dict):
        extra = {k: float(v) for k, v in value.items() if k != "score" and isinstance(v, (int, float))}
        value = value.get("score")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"a reward must be a finite number or a dict with a finite 'score', got {value!r}")
    return float(value), extra


def _call(fn, prompts, responses, ground_truths, extras) -> list:
    out = list(fn(prompts, responses, ground_truths, extras))
    if len(out) != len(prompts):
        raise ValueError(f"the reward function returned {len(out)} values for {len(prompts)} samples")
    return out


def _call_one(fn, i, prompts, responses, ground_truths, extras) -> tuple[object, str | None]:
    """(value, None) or (None, traceback) for sample ``i`` scored alone."""
    one = slice(i, i + 1)
    try:
        return _call(fn, prompts[one], responses[one], ground_truths[one], extras[one])[0], None
    except Exception:
        return None, traceback.format_exc()


def score_batch(fn, prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> ScoreResult:
    """Score the batch in one call; if that raises, score each sample alone so only the failing ones get 0."""
    n = len(prompts)
    try:
        outcomes = [(v, None) for v in _call(fn, prompts, responses, ground_truths, extras)] if n else []
    except Exception:
        outcomes = [_call_one(fn, i, prompts, responses, ground_truths, extras) for i in range(n)]
    result = ScoreResult(scores=[0.0] * n)
    extra_rows: list[dict] = [{} for _ in range(n)]
    for i, (value, error) in enumerate(outcomes):
        if error is None:
            try:
                result.scores[i], extra_rows[i] = _as_score(value)
            except (ValueError, TypeError) as e:
                error = f"sample {i}: {e}"
        if error is not None:
            result.errors += 1
            result.first_error = result.first_error or error
    keys = set.intersection(*(set(r) for r in extra_rows)) if extra_rows else set()
    result.extra = {k: [r[k] for r in extra_rows] for k in sorted(keys)}
    return result
