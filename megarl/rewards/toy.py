"""The quickstart's reward: copy the digit of the prompt (dataset ``builtin:digits``)."""

from __future__ import annotations


def digit_score(response: str, answer: str) -> float:
    """0.5 x the fraction of the response's characters that are digits, plus 0.5 if the response (stripped) is
    exactly the answer. A random model scores ~0.02; answering with any digits reaches 0.5; the right digit 1.0."""
    text = response.strip()
    digits = sum(ch.isdigit() for ch in text) / len(text) if text else 0.0
    return 0.5 * digits + 0.5 * float(text == answer)


def toy_digits(prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> list[float]:
    """Batch reward for ``builtin:digits`` (see ``digit_score``)."""
    return [digit_score(r, str(gt)) for r, gt in zip(responses, ground_truths)]
