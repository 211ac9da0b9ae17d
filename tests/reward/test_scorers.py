"""verl 0.9.1's rule scorers, per data_source, on tables of strings.

Every expected value below is verl 0.9.1's own output on the same strings, obtained by running
verl's scorer functions in a throwaway environment (never part of this repository):

    pip download verl==0.9.1 --no-deps; unzip it; python -m venv /tmp/verlenv;
    /tmp/verlenv/bin/pip install math-verify==0.9.0
    # a stub package exposing only verl/utils/reward_score (its __init__ needs one decorator):
    PYTHONPATH=/tmp/verlstub /tmp/verlenv/bin/python run_verl.py
    # run_verl.py called, for each (response, truth) row:
    #   verl.utils.reward_score.default_compute_score("openai/gsm8k" | "lighteval/MATH" |
    #       "math_dapo" | "aime2024" | "searchR1_nq", response, truth)   (QA truth: {"target": t})
    #   verl.utils.reward_score.gsm8k.compute_score(response, truth, method="flexible")
    #   verl.utils.reward_score.math_verify.compute_score(response, truth)

Only the strings and the numbers are kept here.
"""

from __future__ import annotations

import pytest

from megarl.data.synthetic import DATA_SOURCE as SYNTHETIC
from megarl.reward.scorers import UnsupportedDataSource, default_compute_score, gsm8k
from megarl.reward.scorers.math_verify import math_verify_score

LONG = "Let me think step by step. " * 40

# (response, ground truth, verl 0.9.1's score)
GSM8K = [
    ("The answer is #### 72", "72", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("so #### -3", "-3", 1.0),
    ("#### 3.5", "3.5", 1.0),
    ("The answer is 72", "72", 0.0),
    ("#### 71", "72", 0.0),
    ("#### 5 and finally #### 72", "72", 1.0),
    ("#### 72 but wait #### 5", "72", 0.0),
    ("####72", "72", 0.0),
    ("#### $72", "72", 0.0),
    (LONG + "#### 72", "72", 1.0),
    ("#### 72 " + LONG, "72", 0.0),
    ("#### 72.", "72", 0.0),
    ("#### 1,000,000", "1000000", 1.0),
    ("", "72", 0.0),
    ("#### -", "72", 0.0),
    ("#### .", "72", 0.0),
    ("#### 0.50", "0.5", 0.0),
    ("6 apples and 12 pears: 18", "18", 0.0),
]
GSM8K_FLEXIBLE = [
    ("The answer is 72", "72", 1.0),
    ("6 apples and 12 pears: 18", "18", 1.0),
    ("total 1,000", "1000", 0.0),
    ("total 1,000", "1,000", 1.0),
    ("it is -3.", "-3.", 1.0),
    ("it is -3 .", "-3", 1.0),
    ("no numbers at all", "3", 0.0),
    ("just a dot .", ".", 1.0),
    ("#### 72", "72", 1.0),
    (LONG + "= 45", "45", 1.0),
    ("45 then " + LONG, "45", 0.0),
    ("3.5 or 4.25", "4.25", 1.0),
    ("values 1, 2, 3", "3", 1.0),
    ("... .", "3", 0.0),
    ("answer: 0.5", "0.5", 1.0),
]
MATH = [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{ 2 }", "2", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("the answer is 5", "5", 0.0),
    ("\\boxed{3}", "4", 0.0),
    ("first \\boxed{1} then \\boxed{2}", "2", 1.0),
    ("\\fbox{2}", "2", 0.0),
    ("$\\boxed 2$", "2", 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),
    ("\\boxed{0.25}", "\\frac{1}{4}", 0.0),
    ("\\boxed{1,000}", "1000", 0.0),
    (LONG * 5 + "\\boxed{7}", "7", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{2\\sqrt}", "2\\sqrt", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{5", "5", 0.0),
    ("\\boxed{\\sqrt3}", "\\sqrt{3}", 1.0),
    ("\\boxed{.5}", "0.5", 1.0),
]
MATH_DAPO = [
    ("Answer: 5", "5", 1.0, True, "5"),
    ("answer : 5", "5", 1.0, True, "5"),
    ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}", 1.0, True, "\\frac{1}{2}"),
    ("Answer: 0.5", "\\frac{1}{2}", -1.0, False, "0.5"),
    ("Answer: 1,000", "1000", 1.0, True, "1000"),
    ("Answer: x = 7", "7", 1.0, True, "7"),
    ("so \\boxed{7}", "7", 1.0, True, "7"),
    ("\\boxed{ 7 }", "7", -1.0, False, " 7 "),
    ("\\boxed{\\frac{1}{2}}", "0.5", -1.0, False, "\\frac{1}{2}"),
    ("Answer: 5 dollars", "5", 1.0, True, "5"),
    ("no answer here", "5", -1.0, False, "[INVALID]"),
    ("Answer: 4\nAnswer: 5", "5", 1.0, True, "5"),
    ("Answer: 5" + LONG, "5", -1.0, False, "[INVALID]"),
    ("\\boxed{7}" + "z" * 150, "7", -1.0, False, "[INVALID]"),
    ("Answer: \\boxed{12}", "12", 1.0, True, "12"),
    ("Answer: -3", "-3", 1.0, True, "-3"),
    ("Answer: 3.50", "3.5", -1.0, False, "3.50"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0, True, "\\frac{\\sqrt{3}}{2}"),
    (LONG * 5 + "Answer: 9", "9", 1.0, True, "9"),
]
QA = [
    ("<answer>Paris</answer>", ["Paris", "Paris France"], 1.0),
    ("<answer> the Paris. </answer>", ["Paris"], 1.0),
    ("<answer>London</answer>", ["Paris"], 0.0),
    ("Paris", ["Paris"], 0.0),
    ("<answer>x</answer> then <answer>Paris</answer>", ["Paris"], 1.0),
    ("<answer>Paris</answer>" * 11, ["Paris"], 0.25),
    ("<answer>\nParis\n</answer>", ["Paris"], 1.0),
    ("<answer>Paris, France</answer>", ["Paris France"], 1.0),
    ("<answer>An apple</answer>", ["apple"], 1.0),
    ("<answer>PARIS!</answer>", ["paris"], 1.0),
    ("<answer>Paris", ["Paris"], 0.0),
    ("<answer>Paris</answer>", "Paris", 1.0),
    ("<answer></answer>", ["the"], 1.0),
    (LONG + "<answer>Rome</answer>", ["Rome"], 1.0),
    ("<answer>Rome</answer><answer>Paris</answer>", ["Rome"], 0.0),
]
MATH_VERIFY = [
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
    ("\\boxed{ 2 }", "2", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("x = 1/2", "0.5", 1.0),
    ("no numbers", "2", 0.0),
    ("\\boxed{\\sqrt{4}}", "2", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{(1,2)}", "(1, 2)", 1.0),
    ("first \\boxed{2}, finally \\boxed{3}", "3", 0.0),
    (LONG + "so the result is $7$", "7", 1.0),
    ("\\boxed{\\pi}", "3.14159", 0.0),
    ("\\boxed{\\frac{1}{4}}", "0.25", 1.0),
]


@pytest.mark.parametrize(("response", "truth", "expected"), GSM8K)
def test_gsm8k_strict_matches_verl(response, truth, expected):
    assert default_compute_score("openai/gsm8k", response, truth) == expected


@pytest.mark.parametrize(("response", "truth", "expected"), GSM8K_FLEXIBLE)
def test_gsm8k_flexible_matches_verl(response, truth, expected):
    assert gsm8k.compute_score(response, truth, method="flexible") == expected


@pytest.mark.parametrize(
    "source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"]
)
@pytest.mark.parametrize(("response", "truth", "expected"), MATH)
def test_hendrycks_math_matches_verl(source, response, truth, expected):
    assert default_compute_score(source, response, truth) == expected


def test_hendrycks_math_scores_a_missing_response_zero_like_verl():
    assert default_compute_score("lighteval/MATH", None, "2") == 0.0


@pytest.mark.parametrize("source", ["math_dapo", "math", "math_dapo_reasoning", "aime2024"])
@pytest.mark.parametrize(("response", "truth", "score", "acc", "pred"), MATH_DAPO)
def test_math_dapo_matches_verl(source, response, truth, score, acc, pred):
    assert default_compute_score(source, response, truth) == {
        "score": score,
        "acc": acc,
        "pred": pred,
    }


@pytest.mark.parametrize(("response", "targets", "expected"), QA)
def test_search_r1_exact_match_matches_verl(response, targets, expected):
    assert default_compute_score("searchR1_nq", response, {"target": targets}) == expected


@pytest.mark.parametrize(("response", "truth", "expected"), MATH_VERIFY)
def test_math_verify_matches_verl(response, truth, expected):
    assert math_verify_score(response, truth) == expected


# -- megarl's synthetic task: values from its definition (megarl/data/synthetic.py) ----------


@pytest.mark.parametrize(
    ("response", "truth", "score", "acc"),
    [
        ("57", "57", 1.0, 1.0),  # correct
        ("  57 and more words", "57", 1.0, 1.0),  # leading space, text after the number
        ("58", "57", 0.75, 0.0),  # first digit right: 0.5 + 0.5 * 1/2
        ("47", "57", 0.75, 0.0),  # second digit right
        ("5", "57", 0.75, 0.0),  # one of two digits
        ("570", "57", 0.5 + 0.5 * 2 / 3, 0.0),  # an extra digit costs credit
        ("12", "7", 0.5, 0.0),  # a number, no digit right
        ("the answer is 57", "57", 0.0, 0.0),  # no leading number: malformed
        ("", "57", 0.0, 0.0),
        ("-57", "57", 0.0, 0.0),
        ("٥٧", "57", 0.0, 0.0),  # Arabic-Indic digits are not ASCII digits
    ],
)
def test_synthetic_task_scores_partial_credit(response, truth, score, acc):
    result = default_compute_score(SYNTHETIC, response, truth)
    assert result["score"] == pytest.approx(score)
    assert result["acc"] == acc
    assert result["format"] == (1.0 if score > 0 else 0.0)


def test_unknown_data_source_names_itself():
    with pytest.raises(UnsupportedDataSource, match="'my/task'"):
        default_compute_score("my/task", "x", "1")
