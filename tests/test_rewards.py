"""Rewards: GSM8K extraction and scoring, Math-Verify, loading every spec form (and every error message), and
score_batch turning raising / malformed rewards into 0 plus a counted error."""

import math
import sys
import threading

import numpy as np
import pytest

from megarl.rewards import BUILTIN_REWARDS, RewardLoadError, ScoreResult, load_reward_fn, score_batch
from megarl.rewards.gsm8k import extract_answer, normalize_ground_truth
from megarl.rewards.math_verify_reward import math_score


def _batch(fn, responses, ground_truths):
    n = len(responses)
    return fn(["q"] * n, responses, ground_truths, [{}] * n)


# ---- GSM8K -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so #### 1,234", "1234"),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("#### -7", "-7"),
        ("#### 3.25", "3.25"),
        ("#### $1,000.50.", "1000.50"),  # a currency sign and the sentence's full stop are not the number
        ("#### 5 first, then #### 42", "42"),  # the last marker wins
        ("#### 5 first, then #### no idea", None),  # ... even when nothing numeric follows it
        ("the answer is 42", None),  # strict needs the marker
        ("####42", None),  # GSM8K's marker has a space
    ],
)
def test_gsm8k_strict_extraction(text, expected):
    assert extract_answer(text, "strict") == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 apples and 5 pears, 8 in all.", "8"),
        ("it costs $1,000.50 in total", "1000.50"),
        ("first 12, finally -3", "-3"),
        ("the list 1,2,3", "3"),  # not thousands groups: three numbers
        ("#### 72", "72"),
        ("no numbers here", None),
    ],
)
def test_gsm8k_flexible_extraction(text, expected):
    assert extract_answer(text, "flexible") == expected


def test_gsm8k_unknown_method():
    with pytest.raises(ValueError, match="unknown extraction method 'loose'; use 'strict' or 'flexible'"):
        extract_answer("1", "loose")


def test_gsm8k_ground_truth_is_a_solution_or_a_bare_answer():
    assert normalize_ground_truth("48/2 = 24 clips in May.\n#### 72") == "72"
    assert normalize_ground_truth("1,234") == "1234"
    assert normalize_ground_truth(42) == "42"


def test_gsm8k_strict_scores():
    solution = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    responses = ["... #### 72", "... #### 71", "the answer is 72", "#### 72.00", "#### 1,234"]
    truths = [solution, "72", "72", "72", "1234"]
    assert _batch(BUILTIN_REWARDS["gsm8k"], responses, truths) == [1.0, 0.0, 0.0, 1.0, 1.0]


def test_gsm8k_flexible_scores():
    got = _batch(BUILTIN_REWARDS["gsm8k_flexible"], ["so 72", "72 or maybe 73", "no idea"], ["#### 72", "72", "72"])
    assert got == [1.0, 0.0, 0.0]


def test_gsm8k_without_ground_truth_names_the_fix():
    with pytest.raises(ValueError, match="set data.answer_key"):
        _batch(BUILTIN_REWARDS["gsm8k"], ["#### 1"], [None])


# ---- Math-Verify -------------------------------------------------------------------------------------------------


def test_math_verify_equivalent_wrong_and_unparsable():
    responses = ["so \\boxed{\\frac{1}{2}}", "\\boxed{\\frac{1}{2}}", "I cannot tell", "\\boxed{2}"]
    truths = ["0.5", "1/3", "0.5", "$2$"]
    assert _batch(BUILTIN_REWARDS["math"], responses, truths) == [1.0, 0.0, 0.0, 1.0]


def test_math_verify_wants_a_number_for_a_number_not_the_question_restated():
    """Math-Verify evaluates the expression it extracts: a policy trained on dm_math's additions learned to echo the
    question ('87 - -64' for 151). An operation answering a plain number scores 0; the number itself, the last
    member of an equation, a fraction or a symbolic ground truth are unchanged."""
    assert math_score("To solve 87 - -64, we need to find the difference", "151") == 0.0
    assert math_score("-7908 + -0.1", "-7908.1") == 0.0
    assert math_score("$2 \\times 3$", "6") == 0.0
    assert math_score("87 + 64 = 151", "151") == 1.0
    assert math_score("Therefore, the final answer is $3 + 4 = 7$.", "7") == 1.0
    assert math_score("\\boxed{87 + 64 = 151}", "151") == 1.0
    assert math_score("\\boxed{1.2 \\times 10^{-4}}", "0.00012") == 1.0
    assert math_score("The answer is -7908.1", "-7908.1") == 1.0
    assert math_score("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_score("\\boxed{x+1}", "1+x") == 1.0


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("The answer is 12/4.", "3", 0.0),  # a quotient, a power or a root restates dm_math's question
        ("$\\frac{12}{4}$", "3", 0.0),
        ("\\boxed{\\dfrac{6}{4}}", "1.5", 0.0),
        ("The answer is 3/1.", "3", 0.0),
        ("\\boxed{12 \\div 4}", "3", 0.0),
        ("\\boxed{2^{3}}", "8", 0.0),
        ("The answer is 2**3", "8", 0.0),
        ("\\boxed{\\sqrt{16}}", "4", 0.0),
        ("The answer is 16^(1/2)", "4", 0.0),
        ("x = 12/4", "3", 0.0),
        ("The answer is 7/2.", "3.5", 1.0),  # a fraction in lowest terms is a number
        ("\\boxed{-\\frac{7}{2}}", "-3.5", 1.0),
        ("\\boxed{10^{-4}}", "0.0001", 1.0),  # scientific notation, with or without its mantissa
        ("\\boxed{2 \\times 10^3}", "2000", 1.0),
        ("12/4 = 3", "3", 1.0),  # the last side counts
        ("\\boxed{\\frac{12}{4}}", "\\frac{12}{4}", 1.0),  # not a plain-number ground truth: Math-Verify alone
        ("\\boxed{12 \\over 4}", "3", 0.0),
        ("\\boxed{90^\\circ}", "90", 1.0),  # a degree sign is a unit, not a power
        ("The angle is $90^{\\circ}$.", "90", 1.0),
        ("\\boxed{-7/2}", "-3.5", 1.0),  # Math-Verify extracts '\\frac{-7}{2}': still in lowest terms
        ("$-3/4$", "-0.75", 1.0),
        ("\\boxed{-12/4}", "-3", 0.0),
        ("The answer is 4/8", "0.5", 0.0),  # '0.5' is extracted as '\\frac{1}{2}': the rule reads the given text
        ("\\boxed{2^{-1}}", "0.5", 0.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ],
)
def test_math_verify_a_quotient_power_or_root_is_no_number(response, truth, score):
    """The rule above for the other operations dm_math asks about (division, powers, roots)."""
    assert math_score(response, truth) == score


def test_math_verify_latex_ground_truth_and_missing_one():
    assert math_score("The answer is $2$", "\\boxed{2}") == 1.0
    assert math_score("The answer is $\\sqrt{8}$", "\\boxed{2\\sqrt{2}}") == 1.0
    assert math_score("The answer is $\\sqrt{4}$", "\\boxed{2}") == 0.0  # a root that evaluates to a number
    assert math_score("\\boxed{x+1}", "1+x") == 1.0
    with pytest.raises(ValueError, match="set data.answer_key"):
        math_score("\\boxed{1}", None)


def test_math_verify_outside_the_main_thread():
    # signal.alarm raises outside the main thread; the reward disables the timeouts there instead
    out = {}
    worker = threading.Thread(target=lambda: out.update(got=math_score("\\boxed{\\frac{1}{2}}", "0.5")))
    worker.start()
    worker.join()
    assert out == {"got": 1.0}


# ---- loading -----------------------------------------------------------------------------------------------------


def test_builtins_load_by_name():
    assert set(BUILTIN_REWARDS) == {"toy_digits", "gsm8k", "gsm8k_flexible", "math"}
    for name, fn in BUILTIN_REWARDS.items():
        assert load_reward_fn(name) is fn


def test_load_package_module_form():
    from megarl.rewards.toy import toy_digits

    assert load_reward_fn("megarl.rewards.toy:toy_digits") is toy_digits


USER_FILE = """
from __future__ import annotations
from dataclasses import dataclass

@dataclass
class Weights:  # a dataclass with string annotations needs its module in sys.modules
    length: float = 1.0

def score(prompts, responses, ground_truths, extras):
    return [Weights().length * len(r) for r in responses]
"""


def test_load_a_user_file_absolute_and_relative(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(USER_FILE)
    fn = load_reward_fn(f"{tmp_path / 'mine.py'}:score")
    assert fn(["p", "p"], ["abc", "a"], [None, None], [{}, {}]) == [3.0, 1.0]
    assert fn.__module__ in sys.modules  # registered: picklable by reference
    monkeypatch.chdir(tmp_path)
    again = load_reward_fn("mine.py:score")  # relative to the CWD
    assert again.__module__ == fn.__module__ and again(["p"], ["ab"], [None], [{}]) == [2.0]


def test_unknown_builtin_lists_the_choices_and_forms():
    with pytest.raises(RewardLoadError) as e:
        load_reward_fn("gsm9k")
    message = str(e.value)
    assert "unknown reward 'gsm9k'" in message
    assert all(name in message for name in BUILTIN_REWARDS)
    assert "'path/to/file.py:fn'" in message and "'package.module:fn'" in message


def test_a_file_without_function_name_suggests_the_colon_form():
    with pytest.raises(RewardLoadError, match=r"unknown reward 'reward\.py'.*write 'reward\.py:fn'"):
        load_reward_fn("reward.py")


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "r.py"
    with pytest.raises(RewardLoadError) as e:
        load_reward_fn(f"{missing}:fn")
    assert f"reward file not found: {missing}" in str(e.value) and "'path/to/file.py:fn'" in str(e.value)


def test_import_error_inside_a_user_file_names_type_message_and_place(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\nimport not_a_real_package\n")
    with pytest.raises(RewardLoadError) as e:
        load_reward_fn(f"{broken}:fn")
    message = str(e.value)
    assert f"importing reward file {broken}:2" in message
    assert "ModuleNotFoundError: No module named 'not_a_real_package'" in message
    assert not any(getattr(m, "__file__", None) == str(broken) for m in list(sys.modules.values()))  # unregistered


def test_syntax_error_in_a_user_file_names_the_line(tmp_path):
    broken = tmp_path / "syntax.py"
    broken.write_text("def fn(:\n")
    with pytest.raises(RewardLoadError, match=rf"{broken}:1 .*SyntaxError"):
        load_reward_fn(f"{broken}:fn")


def test_unimportable_module_names_it_and_the_fix():
    with pytest.raises(RewardLoadError) as e:
        load_reward_fn("megarl.no_such_module:fn")
    message = str(e.value)
    assert "importing module 'megarl.no_such_module'" in message and "ModuleNotFoundError" in message
    assert "PYTHONPATH" in message and "'path/to/file.py:fn'" in message


def test_missing_attribute_lists_the_functions_there(tmp_path):
    with pytest.raises(RewardLoadError) as e:
        load_reward_fn("megarl.rewards.toy:toy_digit")
    message = str(e.value)
    assert "megarl.rewards.toy has no attribute 'toy_digit'" in message and "'toy_digits'" in message
    (tmp_path / "r.py").write_text("def score(p, r, g, e):\n    return [0.0] * len(r)\n")
    with pytest.raises(RewardLoadError, match=r"has no attribute 'scor'.*\['score'\]; name one after the ':'"):
        load_reward_fn(f"{tmp_path / 'r.py'}:scor")


def test_not_callable_names_the_expected_signature():
    with pytest.raises(RewardLoadError) as e:
        load_reward_fn("megarl.rewards.toy:DIGITS")
    assert "'megarl.rewards.toy:DIGITS' is a frozenset, not a function" in str(e.value)
    assert "fn(prompts, responses, ground_truths, extras)" in str(e.value)


# ---- score_batch -------------------------------------------------------------------------------------------------


def _raises_on_boom(prompts, responses, ground_truths, extras):
    out = []
    for r in responses:
        if r == "boom":
            raise RuntimeError("exploded on purpose")
        out.append(float(len(r)))
    return out


def _score(fn, responses):
    n = len(responses)
    return score_batch(fn, ["p"] * n, responses, [None] * n, [{}] * n)


def test_a_raising_sample_scores_zero_and_the_others_keep_their_scores():
    result = _score(_raises_on_boom, ["a", "boom", "abc", "boom"])
    assert result.scores == [1.0, 0.0, 3.0, 0.0] and result.errors == 2
    assert result.failed == ["", "error", "", "error"]
    assert result.first_error.startswith("the sample of prompt 'p' raised:\nTraceback (most recent call last)")
    assert "RuntimeError: exploded on purpose" in result.first_error and "_raises_on_boom" in result.first_error
    assert _score(_raises_on_boom, ["a", "boom", "abc", "boom"]) == result  # deterministic


def test_a_clean_batch_has_no_errors():
    result = _score(_raises_on_boom, ["ab", "c"])
    assert result == ScoreResult(scores=[2.0, 1.0], failed=["", ""], extra={}, first_error=None)
    assert result.errors == result.timeouts == 0
    assert _score(_raises_on_boom, []) == ScoreResult(scores=[])


def test_dict_results_keep_extra_fields_present_on_every_sample():
    def fn(p, r, g, e):
        return [{"score": 1.0, "format": 0.5, "note": "text"}, {"score": 0, "format": 1, "length": 3.0}]

    result = _score(fn, ["a", "b"])
    assert result.scores == [1.0, 0.0] and result.errors == 0
    assert result.extra == {"format": [0.5, 1.0]}  # 'length' is on one sample only; 'note' is not a number


def test_non_finite_and_non_numeric_values_are_errors():
    def fn(p, r, g, e):
        return [float("nan"), {"score": math.inf}, "1.0", {"format": 1.0}, 0.75]

    result = _score(fn, list("abcde"))
    assert result.scores == [0.0, 0.0, 0.0, 0.0, 0.75] and result.errors == 4
    assert result.first_error == (
        "the sample of prompt 'p' returned nan; a reward must be a finite number or a dict with a finite 'score'"
    )


def test_numpy_and_bool_scores_are_numbers():
    result = _score(lambda p, r, g, e: [np.float32(0.5), np.int64(1), True], ["a", "b", "c"])
    assert result.scores == [0.5, 1.0, 1.0] and result.errors == 0
    assert all(type(s) is float for s in result.scores)


def test_wrong_length_results_are_retried_per_sample():
    # 1 value for 2 samples: each sample alone gets its 1 value
    assert _score(lambda p, r, g, e: [1.0], ["a", "b"]).scores == [1.0, 1.0]
    # a reward that silently skips the sample it cannot score: only that sample is an error
    skips = lambda p, r, g, e: [float(len(x)) for x in r if x != "?"]
    result = _score(skips, ["ab", "?", "c"])
    assert result.scores == [2.0, 0.0, 1.0] and result.errors == 1
    assert "returned 0 values for 1 samples" in result.first_error
    empty = _score(lambda p, r, g, e: [], ["a", "b"])
    assert empty.scores == [0.0, 0.0] and empty.errors == 2


def test_sys_exit_in_an_in_process_reward_is_that_sample_s_error():
    def exits_on_b(p, r, g, e):
        if "b" in r:
            raise SystemExit(0)
        return [1.0] * len(r)

    result = _score(exits_on_b, ["a", "b", "c"])
    assert result.scores == [1.0, 0.0, 1.0] and result.failed == ["", "error", ""]
    assert result.first_error.endswith("SystemExit: 0")


def test_mismatched_inputs_are_a_caller_bug():
    with pytest.raises(ValueError, match="2 prompts, 1 responses"):
        score_batch(_raises_on_boom, ["p", "p"], ["a"], [None, None], [{}, {}])


def test_toy_digit_score_hand_values():
    from megarl.rewards.toy import digit_score

    assert digit_score("7", "7") == 1.0
    assert digit_score("77ab", "7") == pytest.approx(0.5 * 0.5 + 0.5)
    assert digit_score("3", "7") == 0.5
    assert digit_score("xyz", "7") == 0.0 and digit_score("", "7") == 0.0
    assert digit_score("\u00b2", "7") == 0.0  # a superscript is not an ASCII digit


def test_overlong_penalty_ramp():
    from megarl.rewards.shaping import overlong_penalty

    assert overlong_penalty(12, 16, 4, 1.0) == 0.0
    assert overlong_penalty(14, 16, 4, 1.0) == -0.5
    assert overlong_penalty(16, 16, 4, 0.5) == -0.5
