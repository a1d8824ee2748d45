"""Math answers checked with HF's Math-Verify (``math-verify`` 0.9.0): parse both sides, then symbolic equality.

Call it from the main thread: Math-Verify bounds each parse / comparison with ``signal.alarm``, which Python allows
only there. In any other thread the timeouts are passed as ``None`` (disabled) instead of raising, so a pathological
expression can then run long. (Named ``math_verify_reward`` so that no ``math.py`` shadows the standard library.)

A ground truth that is a plain number needs an answer that is a number, not an operation that evaluates to it:
Math-Verify evaluates what it extracts, so "To solve 87 - -64, we need" scored 1 for 151. Trained on dm_math's
additions with that hole, SmolLM2-135M learned to restate the question (``make demo-real``: 69 of the 76 validation
answers scored correct at step 20 held no answer, only the question's expression). The same holds for a quotient, a
power or a root ('12/4', '\\frac{12}{4}', '12 \\div 4' for 3; '2^3', '2**3' for 8; '\\sqrt{16}' for 4): dm_math
asks for those too. A fraction in lowest terms ('\\frac{1}{2}', '7/2') is a number, as is scientific notation."""

from __future__ import annotations

import re
import threading
from math import gcd

TIMEOUT_S = 5
"""Seconds per parse and per comparison (main thread only)."""


def _timeout_s() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _gold_text(ground_truth) -> str:
    """A bare answer ('0.5', '\\frac{1}{2}') is wrapped in $...$ so the LaTeX extractor finds it."""
    truth = str(ground_truth).strip()
    return truth if "$" in truth or "\\boxed" in truth else f"${truth}$"


_PLAIN_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_OPERATION = re.compile(
    r"[0-9.)}]\s*(?:\*\*|[-+*/^\u00d7\u00b7\u00f7])\s*[-+(]?\s*[0-9(\\{]|\\(?:times|cdot|div|over|[dt]?frac|sqrt)|\u221a"
)
"""A binary +, -, x, /, ^ or ** between operands ('87 - -64', '2 \\times 3', '12/4', '2^{3}'), a division sign, a
LaTeX fraction or a root; a leading sign is not one."""
_POWER_OF_TEN = re.compile(
    r"(?:\s*(?:\\times|\\cdot|[*\u00d7\u00b7])\s*|(?<![0-9.]))10\s*\^\s*(?:\{\s*[-+]?[0-9]+\s*\}|[-+]?[0-9]+)"
)
"""Scientific notation's 'x 10^{-4}' (or a bare '10^{-4}'): part of a number, not an operation."""
_DEGREES = re.compile(r"\s*\^\s*(?:\{\s*\\circ\s*\}|\\circ)")
"""A degree sign, '^\\circ' or '^{\\circ}': a unit, not a power."""
_FRACTION = re.compile(
    r"\\[dt]?frac\s*\{\s*(-?[0-9]+)\s*\}\s*\{\s*(-?[0-9]+)\s*\}|(?<![0-9.])([0-9]+)\s*/\s*([0-9]+)(?![0-9]|\.[0-9])"
)
"""A fraction of two integer literals, LaTeX (Math-Verify writes '-7/2' as '\\frac{-7}{2}') or 'a/b'."""


def _numbers_for_fractions(text: str) -> str:
    """Each fraction in lowest terms with a denominator above 1 ('\\frac{1}{2}', '7/2': a rational number) replaced
    by a digit; an unreduced one ('12/4', '\\frac{6}{2}', '3/1': a division) left in place."""

    def number(m: re.Match) -> str:
        a, b = int(m[1] or m[3]), int(m[2] or m[4])
        return "1" if abs(b) > 1 and gcd(a, b) == 1 else m[0]

    return _FRACTION.sub(number, text)


def restates(gold_text: str, answer_text: str) -> bool:
    """Whether an answer to a plain-number ground truth is an unevaluated operation (the ground truth as given or as
    Math-Verify extracted it, which turns '0.5' into '\\frac{1}{2}'; the answer as extracted; see the module
    docstring). Only the last side of an equation counts ('$87 + 64 = 151$' answers 151)."""
    if not _PLAIN_NUMBER.fullmatch(gold_text.strip()):
        return False
    last_side = _DEGREES.sub("", answer_text.rsplit("=", 1)[-1])
    return bool(_OPERATION.search(_numbers_for_fractions(_POWER_OF_TEN.sub("", last_side))))


def math_score(response: str, ground_truth) -> float:
    """1.0 when the response's final answer equals the ground truth, 0.0 otherwise (a side that fails to parse or
    times out scores 0, as does an operation answering a plain number: ``restates``)."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    if ground_truth is None:
        raise ValueError("the math reward needs the ground truth: set data.answer_key (e.g. answer)")
    timeout_s = _timeout_s()
    try:
        gold = parse(_gold_text(ground_truth), parsing_timeout=timeout_s)
        answer = parse(response, parsing_timeout=timeout_s)
        given = str(ground_truth).strip()
        if not gold or not answer or restates(given if _PLAIN_NUMBER.fullmatch(given) else gold[-1], answer[-1]):
            return 0.0
        return float(verify(gold, answer, timeout_seconds=timeout_s))
    except TimeoutException:  # a BaseException: Math-Verify catches it itself, but never let one stop the run
        return 0.0


def math(prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> list[float]:
    """1.0 when Math-Verify finds the response's final answer equal to the ground truth, else 0.0."""
    return [math_score(r, gt) for r, gt in zip(responses, ground_truths)]
