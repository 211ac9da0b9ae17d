"""verl 0.9.1's PRIME math grader (``numina_*``) and Geometry3K scorer, on tables of strings.

Every expected value below is verl 0.9.1's own output on the same strings, obtained by running
verl's scorer functions in a throwaway environment (never part of this repository):

    pip download verl==0.9.1 --no-deps; unzip it; python -m venv /tmp/scorers-math/venv
    /tmp/scorers-math/venv/bin/pip install sympy==1.14.0 pylatexenc==2.11 mathruler==0.1.0 \\
        tqdm numpy
    # a stub package: verl/utils/{reward_score, py_functional.py} copied from the wheel, with
    # verl/utils/import_utils.py (a no-op ``deprecated``) and verl/utils/metric (a ``Metric``)
    PYTHONPATH=/tmp/scorers-math/stub /tmp/scorers-math/venv/bin/python run_verl.py
    # run_verl.py called, for each (response, truth) row:
    #   verl.utils.reward_score.default_compute_score("numina_olympiads", response, truth)
    #   verl.utils.reward_score.default_compute_score("hiyouga/geometry3k", response, truth)

(Python 3.11 on Linux, so verl's per-comparison sympy child process is forked.) The same run
over 1316 further (response, truth) pairs built from 92 answer forms and 9 wrappings found no
difference between verl and megarl for either scorer. Only the strings and the numbers are kept.
"""

from __future__ import annotations

import signal

import pytest

from megarl.reward.scorers import default_compute_score
from megarl.reward.scorers.prime_math import equal_under_sympy
from megarl.reward.scorers.prime_math_equal import evaluate_arithmetic

LONG = "Let me think step by step. " * 40
NUMINA_SOURCES = [
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
]

# (response, ground truth, verl 0.9.1's score)
NUMINA = [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{ 2 }", "2", 1.0),
    ("The answer is 5", "5", 1.0),
    ("The answer is 5.", "5", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("first \\boxed{1} then \\boxed{2}", "2", 1.0),
    ("no box here, just 7", "7", 0.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{- 3}", "-3", 1.0),
    ("\\boxed{3.50}", "3.5", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{[1, 2)}", "(1,2)", 0.0),
    ("\\boxed{2/4}", "\\frac{1}{2}", 0.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{0.5}", "50\\%", 1.0),
    ("\\boxed{\\$12}", "12", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{7 3/4}", "\\frac{31}{4}", 1.0),
    ("\\boxed{2\\pi}", "6.28", 1.0),
    ("\\boxed{\\frac{\\pi}{2}}", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{101_2}", "101", 1.0),
    ("\\boxed{x_1}", "2", 0.0),
    ("\\boxed{\\text{(A)}}", "A", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{\\left( \\frac{1}{2}, -3 \\right)}", "(0.5,-3)", 1.0),
    ("Answer: x = 12", "12", 1.0),
    ("12 is the answer", "12", 1.0),
    ("we get 12", "12", 1.0),
    (LONG + "\\boxed{42}", "42", 1.0),
    ("\\boxed{42}" + LONG, "42", 1.0),
    ("", "1", 0.0),
    ("\\boxed{}", "0", 0.0),
    ("\\boxed{5", "5", 1.0),
    ("\\boxed{3 million}", "3000000", 0.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("Point(1, 2)", "(1,2)", 0.0),
    ("\\boxed{Interval(0, 1)}", "[0,1]", 1.0),
    ("\\boxed{[[1], [2]]}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 0.0),
    ("\\boxed{Matrix([[1], [2]])}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1.0),
    ("\\boxed{1e3}", "1000", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{a+b+c}", "c+b+a", 0.0),
    ("\\boxed{3, 5}", "5, 3", 0.0),
    ("\\boxed{3 \\text{ or } 5}", "3,5", 0.0),
    ("\\boxed{\\text{Yes}}", "yes", 1.0),
    ("\\fbox{4}", "4", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
    ("\\boxed{0.3333}", "\\frac{1}{3}", 0.0),
    ("\\boxed{2^{10}}", "1024", 0.0),
    ("So the total is 12", "12", 1.0),
    ("Thus x = 12", "12", 1.0),
    ("The answers are 3 and 5", "3, 5", 0.0),
    ("The answer is 4. Check: 2+2 is 4", "4", 1.0),
    ("\\boxed{3.1416}", "\\pi", 1.0),
    ("\\boxed{3.14}", "\\pi", 1.0),
    ("\\boxed{12.00001}", "12", 1.0),
    ("\\boxed{0.1234}", "0.12341", 1.0),
]
GEO3K = [
    ("<think>angles sum to 180</think> \\boxed{60}", "60", 1.0),
    ("\\boxed{60}", "60", 0.9),
    ("<think>x</think> \\boxed{61}", "60", 0.1),
    ("<think>x</think> 60", "60", 0.0),
    ("<think>x</think>\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("<think>x</think>\\boxed{ 2 }", "2", 1.0),
    ("<think>x</think>\\boxed{60^\\circ}", "60", 1.0),
    ("<think>x</think>\\boxed{2\\sqrt{3}}", "2\\sqrt3", 1.0),
    ("<think>x</think>\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("<think>\nmulti\nline\n</think>\nso \\boxed{12}.", "12", 1.0),
    ("<think>x</think> first \\boxed{1} then \\boxed{2}", "2", 1.0),
    ("<think>x</think>\\boxed{1,000}", "1000", 1.0),
    ("<think>x</think>\\boxed{-3}", "-3", 1.0),
    ("<think>x</think>\\boxed{3.50}", "3.5", 1.0),
    ("<think>x</think>\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("no box at all", "None", 0.9),
    ("<think>x</think>", "60", 0.0),
    ("<think>" + LONG + "</think>\\boxed{7}", "7", 1.0),
    ("\\boxed{7}<think>x</think>", "7", 0.9),
    ("<think>x</think>\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("<think>x</think>\\boxed{2/4}", "\\frac{1}{2}", 0.1),
    ("", "1", 0.0),
    ("<think>x</think>\\boxed{5", "5", 0.0),
]


@pytest.mark.parametrize(("response", "truth", "expected"), NUMINA)
def test_prime_math_matches_verl(response, truth, expected):
    assert default_compute_score("numina_olympiads", response, truth) == expected


@pytest.mark.parametrize("source", NUMINA_SOURCES)
def test_every_numina_source_uses_the_prime_grader(source):
    """The first 15 rows (commas, signs, decimals, boxes, no box, wrong answers) per source."""
    assert [default_compute_score(source, r, t) for r, t, _ in NUMINA[:15]] == [
        expected for _, _, expected in NUMINA[:15]
    ]


@pytest.mark.parametrize(("response", "truth", "expected"), GEO3K)
def test_geometry3k_matches_verl(response, truth, expected):
    assert default_compute_score("hiyouga/geometry3k", response, truth) == expected


def test_sympy_comparison_is_cut_off_by_its_time_limit():
    """verl gives each sympy comparison 10 s and counts a timeout as unequal; so does megarl."""
    handler = signal.getsignal(signal.SIGALRM)
    assert equal_under_sympy("(x+1)^2", "x^2+2x+1")
    assert not equal_under_sympy("(x+1)^2", "x^2+2x+1", timeout_s=1e-6)
    assert signal.getsignal(signal.SIGALRM) is handler  # restored: no stray alarm handler left


@pytest.mark.parametrize(
    "text",
    ["__import__('os').getpid()", "x*3.14", "[print(1)]", "(1).__class__", "2**10**10", "'a'*3"],
)
def test_model_output_is_not_evaluated_as_python(text):
    """verl passes model output to eval(); megarl evaluates only arithmetic on number literals."""
    with pytest.raises(ValueError):
        evaluate_arithmetic(text)


def test_arithmetic_evaluates_as_python_does():
    assert evaluate_arithmetic(" 2*3.141592653589793") == 2 * 3.141592653589793
    assert evaluate_arithmetic("(1*3.14, -2)") == (3.14, -2)
    assert evaluate_arithmetic("[[1], [2/4]]") == [[1], [0.5]]
