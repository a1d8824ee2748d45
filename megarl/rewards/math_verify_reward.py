"""Math answers checked with HF's Math-Verify (``math-verify`` 0.9.0): parse both sides, then symbolic equality.

Math-Verify bounds its parse/verify time with ``signal.alarm``, which works only in the main thread; elsewhere the
timeouts are disabled (``None``) rather than raising."""

from __future__ import annotations

import threading

TIMEOUT_S = 5


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def math_score(response: str, ground_truth) -> float:
    from math_verify import parse, verify

    truth = str(ground_truth)
    if "$" not in truth and "\\boxed" not in truth:
        truth = f"${truth}$"
    timeout = _timeout()
    gold = parse(truth, parsing_timeout=timeout)
    answer = parse(response, parsing_timeout=timeout)
    if not gold or not answer:
        return 0.0
    return float(verify(gold, answer, timeout_seconds=timeout))


def math(prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> list[float]:
    """1.0 when Math-Verify finds the response's final answer equal to the ground truth."""
    return [math_score(r, gt) for r, gt in zip(responses, ground_truths)]
