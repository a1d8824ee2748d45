"""GSM8K answers: the number after the last ``#### `` (strict) or the last number in the text (flexible)."""

from __future__ import annotations

import re

_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def extract_answer(text: str, method: str = "strict") -> str | None:
    """The final answer as a plain number string (commas removed, trailing '.' dropped), or None."""
    if method == "strict":
        found = _STRICT.findall(text)
    elif method == "flexible":
        found = _NUMBER.findall(text)
    else:
        raise ValueError(f"unknown extraction method {method!r}; use 'strict' or 'flexible'")
    if not found:
        return None
    return found[-1].replace(",", "").rstrip(".")


def _ground_truth(gt) -> str | None:
    """A bare answer or a full GSM8K solution ending in '#### 42'."""
    text = str(gt)
    return extract_answer(text, "strict") or extract_answer(text, "flexible")


def _score(responses, ground_truths, method) -> list[float]:
    out = []
    for response, gt in zip(responses, ground_truths):
        answer, truth = extract_answer(response, method), _ground_truth(gt)
        out.append(float(answer is not None and truth is not None and _same_number(answer, truth)))
    return out


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def gsm8k(prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> list[float]:
    """1.0 when the response's '#### N' answer equals the ground truth, else 0.0."""
    return _score(responses, ground_truths, "strict")


def gsm8k_flexible(prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> list[float]:
    """1.0 when the last number of the response equals the ground truth, else 0.0."""
    return _score(responses, ground_truths, "flexible")
