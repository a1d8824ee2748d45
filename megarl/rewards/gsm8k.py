"""GSM8K answers: the number after the last ``#### `` (strict) or the last number in the text (flexible)."""

from __future__ import annotations

import re

MARKER = "#### "
# thousands groups ('1,234,567') or plain digits, then decimals; '1,2,3' is three numbers, not 123
_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?")
_AFTER_MARKER = re.compile(r"\s*\$?\s*(" + _NUMBER.pattern + ")")  # '#### $1,234' is still an answer


def extract_answer(text: str, method: str = "strict") -> str | None:
    """The final answer as a plain number string (commas removed), or None.

    strict: the number right after the last '#### ' (GSM8K's format); flexible: the last number anywhere."""
    if method == "strict":
        at = text.rfind(MARKER)
        found = _AFTER_MARKER.match(text, at + len(MARKER)) if at >= 0 else None
        number = found.group(1) if found else None
    elif method == "flexible":
        numbers = _NUMBER.findall(text)
        number = numbers[-1] if numbers else None
    else:
        raise ValueError(f"unknown extraction method {method!r}; use 'strict' or 'flexible'")
    return None if number is None else number.replace(",", "")


def normalize_ground_truth(gt) -> str | None:
    """A bare answer ('42', 42, '1,234') or a full GSM8K solution ending in '#### 42', as a plain number string."""
    if gt is None:
        raise ValueError("GSM8K rewards need the ground truth: set data.answer_key (e.g. answer)")
    text = str(gt)
    return extract_answer(text, "strict") or extract_answer(text, "flexible")


def same_number(a: str, b: str) -> bool:
    """'72' == '72.0' == '72.00'; falls back to string equality for what float() refuses."""
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def _score(responses: list[str], ground_truths: list, method: str) -> list[float]:
    out = []
    for response, gt in zip(responses, ground_truths):
        answer, truth = extract_answer(response, method), normalize_ground_truth(gt)
        out.append(float(answer is not None and truth is not None and same_number(answer, truth)))
    return out


def gsm8k(prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> list[float]:
    """1.0 when the response's '#### N' answer equals the ground truth, else 0.0."""
    return _score(responses, ground_truths, "strict")


def gsm8k_flexible(prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> list[float]:
    """1.0 when the last number of the response equals the ground truth, else 0.0."""
    return _score(responses, ground_truths, "flexible")
