"""Reward functions: built-ins (GSM8K strict/flexible, math-verify, the toy task), loading user functions, and
scoring that turns a raising or malformed reward into 0 plus a counted error."""

import math

import pytest

from megarl.rewards import BUILTIN_REWARDS, RewardLoadError, load_reward_fn, score_batch
from megarl.rewards.gsm8k import extract_answer
from megarl.rewards.shaping import overlong_penalty
from megarl.rewards.toy import digit_score


@pytest.mark.parametrize(
    "text, method, expected",
    [
        ("so the total is 12.\n#### 1,234", "strict", "1234"),
        ("#### -7 and later #### 42", "strict", "42"),
        ("the answer is 42", "strict", None),
        ("3 apples and 5 pears, 8 in all.", "flexible", "8"),
        ("it costs $1,000.50 in total", "flexible", "1000.50"),
        ("no numbers here", "flexible", None),
    ],
)
def test_gsm8k_extraction(text, method, expected):
    assert extract_answer(text, method) == expected


def test_gsm8k_scores_against_a_bare_or_full_ground_truth():
    fn = BUILTIN_REWARDS["gsm8k"]
    solution = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert fn(["q"] * 3, ["... #### 72", "... #### 71", "72"], [solution, "72", "72"], [{}] * 3) == [1.0, 0.0, 0.0]
    flexible = BUILTIN_REWARDS["gsm8k_flexible"]
    assert flexible(["q", "q"], ["so 72", "so 72 or 73"], ["72", "72"], [{}, {}]) == [1.0, 0.0]


def test_math_verify_equivalent_and_wrong_answers():
    fn = BUILTIN_REWARDS["math"]
    got = fn(["q"] * 3, ["\\boxed{\\frac{1}{2}}", "\\boxed{\\frac{1}{3}}", "garbage"], ["0.5", "0.5", "0.5"], [{}] * 3)
    assert got == [1.0, 0.0, 0.0]


def test_toy_digit_score_hand_values():
    assert digit_score("7", "7") == 1.0
    assert digit_score("77ab", "7") == pytest.approx(0.5 * 0.5 + 0.5)
    assert digit_score("3", "7") == 0.5
    assert digit_score("xyz", "7") == 0.0 and digit_score("", "7") == 0.0
    assert digit_score("\u00b2", "7") == 0.0  # a superscript is not an ASCII digit


def test_overlong_penalty_ramp():
    assert overlong_penalty(12, 16, 4, 1.0) == 0.0
    assert overlong_penalty(14, 16, 4, 1.0) == -0.5
    assert overlong_penalty(16, 16, 4, 0.5) == -0.5


def test_load_every_form(tmp_path, monkeypatch):
    assert load_reward_fn("gsm8k") is BUILTIN_REWARDS["gsm8k"]
    assert load_reward_fn("megarl.rewards.toy:toy_digits") is BUILTIN_REWARDS["toy_digits"]
    (tmp_path / "mine.py").write_text("def score(p, r, g, e):\n    return [len(x) for x in r]\n")
    fn = load_reward_fn(f"{tmp_path / 'mine.py'}:score")
    assert fn(["a"], ["abc"], [None], [{}]) == [3]
    monkeypatch.chdir(tmp_path)
    assert load_reward_fn("mine.py:score")(["a"], ["ab"], [None], [{}]) == [2]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such", "unknown reward 'no_such'; use a built-in (toy_digits, gsm8k"),
        ("/nope/r.py:fn", "reward file not found: /nope/r.py"),
        ("megarl.no_such_module:fn", "importing module 'megarl.no_such_module'"),
        ("megarl.rewards.toy:nothing", "has no attribute 'nothing'"),
        ("megarl.rewards.toy:DIGITS", "is a frozenset, not a function"),
    ],
)
def test_load_errors_name_the_spec_and_fix(spec, message):
    with pytest.raises(RewardLoadError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_reward_fn(spec)


def test_import_error_inside_a_user_file(tmp_path):
    (tmp_path / "broken.py").write_text("import not_a_real_package\n")
    with pytest.raises(RewardLoadError, match="ModuleNotFoundError: No module named 'not_a_real_package'"):
        load_reward_fn(f"{tmp_path / 'broken.py'}:fn")


def _flaky(prompts, responses, ground_truths, extras):
    out = []
    for r in responses:
        if r == "boom":
            raise RuntimeError("exploded on purpose")
        out.append(float(len(r)))
    return out


def test_a_raising_reward_scores_only_the_failing_samples_zero():
    result = score_batch(_flaky, ["p"] * 4, ["a", "boom", "abc", "boom"], [None] * 4, [{}] * 4)
    assert result.scores == [1.0, 0.0, 3.0, 0.0]
    assert result.errors == 2
    assert "RuntimeError: exploded on purpose" in result.first_error and "Traceback" in result.first_error


def test_dict_results_and_bad_values():
    def fn(p, r, g, e):
        return [{"score": 1.0, "format": 0.5}, {"score": float("nan"), "format": 1.0}, {"score": 0.25, "format": 0.0}]

    result = score_batch(fn, ["p"] * 3, ["a", "b", "c"], [None] * 3, [{}] * 3)
    assert result.scores == [1.0, 0.0, 0.25] and result.errors == 1
    assert "finite" in result.first_error
    assert result.extra == {}  # 'format' is missing on the failed sample: not kept
    ok = score_batch(lambda p, r, g, e: [{"score": 1, "format": 0.5}] * len(r), ["p"] * 2, ["a", "b"], [None] * 2,
                     [{}] * 2)  # fmt: skip
    assert ok.scores == [1.0, 1.0] and ok.extra == {"format": [0.5, 0.5]} and ok.errors == 0


def test_wrong_length_is_an_error_for_every_sample():
    result = score_batch(lambda p, r, g, e: [1.0], ["p"] * 2, ["a", "b"], [None] * 2, [{}] * 2)
    # the batch call fails (1 value for 2 samples); per sample the function returns 1 value each: fine
    assert result.scores == [1.0, 1.0] and result.errors == 0
    result = score_batch(lambda p, r, g, e: [], ["p"] * 2, ["a", "b"], [None] * 2, [{}] * 2)
    assert result.scores == [0.0, 0.0] and result.errors == 2 and all(math.isfinite(s) for s in result.scores)
