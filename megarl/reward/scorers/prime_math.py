"""PRIME math grader (``numina_aops_forum``, ``numina_synthetic_math``, ``numina_amc_aime``,
``numina_synthetic_amc``, ``numina_cn_k12``, ``numina_olympiads``): 1.0 right, 0.0 wrong.

Same semantics and values as verl 0.9.1's ``verl/utils/reward_score/prime_math/``, written from
its behaviour, in three steps: extraction (:func:`extract_answer`), PRM800K grading
(:func:`grade_answer`), then the ToRA comparison (:mod:`.prime_math_equal`) when PRM800K says
no. verl runs each ``sympy`` comparison in a forked child to time it out; here it runs in the
scoring worker itself under a ``SIGALRM`` timer of the same 10 s (:func:`_time_limit`). verl's
match and format flags never reach the score, so they are not computed.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
from collections.abc import Iterator

from megarl.reward.scorers.boxed import closing_brace, last_box_start
from megarl.reward.scorers.hendrycks_math import strip_string
from megarl.reward.scorers.prime_math_equal import pi_aware_math_equal

__all__ = ["compute_score", "extract_answer", "grade_answer", "normalize_answer"]

SYMPY_TIMEOUT_S = 10.0
"""verl's limit on one ``sympy.simplify`` comparison (``@timeout_limit(seconds=10)``)."""

_AFTER_MARKERS = ("answer:", "answer is", "answers are")
_BEFORE_MARKERS = ("is answer", "is the answer", "are answers", "are the answers")
_LAST_MARKERS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")
_UNITS = (
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
    "month", "year", "foot", "feet", "inch", "yard", "liter",
)  # fmt: skip
_UNIT_PATTERNS = tuple(re.compile(f"{unit}(es)?(s)? *(\\^[0-9]+)?") for unit in _UNITS)
_TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")
# sympy may hang on these; PRM800K does not try to be lenient with them.
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_REGEXES = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_TUPLE_CHARS = "()[]"


# -- 1. extraction ----------------------------------------------------------------------------


def _last_boxed_content(text: str) -> str | None:
    """Stripped content of the last ``\\boxed{...}`` (else ``\\fbox{...}``), or None."""
    start = last_box_start(text)
    end = None if start is None else closing_brace(text, start)
    if end is None:
        return None
    return text[text.index("{", start) + 1 : end].strip()


def _after_last(text: str, markers: tuple[str, ...]) -> str:
    """For each marker in turn, the stripped text after its last (case-insensitive) occurrence."""
    for marker in markers:
        pos = text.lower().rfind(marker)
        if pos != -1:
            text = text[pos + len(marker) :].strip()
    return text


def extract_answer(response: str) -> str:
    """The final answer verl's PRIME grader reads out of a response.

    The text after the last ``answer:`` / ``answer is`` / ``answers are`` (case-insensitive),
    then before the last ``is the answer`` (and kin); then the content of the last
    ``\\boxed{...}``/``\\fbox{...}`` when there is one and it is not empty; then the text
    before the last ``". "``; then the text after the last ``be ``, ``is ``, ``are ``, ``=``,
    ``": "`` or ``get `` (each marker in turn).
    """
    response = _after_last(response, _AFTER_MARKERS)
    for marker in _BEFORE_MARKERS:
        pos = response.lower().rfind(marker)
        if pos != -1:
            response = response[:pos].strip()
    boxed = _last_boxed_content(response)
    if boxed:
        response = boxed
    if ". " in response:
        response = response[: response.lower().rfind(". ")].strip()
    return _after_last(response, _LAST_MARKERS)


# -- 2. PRM800K grading -----------------------------------------------------------------------


def normalize_answer(answer: str) -> str:
    """Hendrycks-MATH normal form, after unwrapping ``\\text{...}``; the input when that fails."""
    answer = answer.strip()
    try:
        wrapped = _TEXT_WRAPPED.search(answer)
        if wrapped is not None:
            answer = wrapped.group("text").strip()
        return strip_string(answer)
    except Exception:  # noqa: BLE001 -- verl keeps the unwrapped text on any normaliser failure
        return answer


def _latex_to_text(expr: str) -> str:
    """LaTeX rendered as plain text sympy can read (``\\frac{1}{2}`` -> ``1/2``)."""
    from pylatexenc import latex2text

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # so that mixed numbers stay apart
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, name in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*")):
        expr = expr.replace(symbol, name)
    return expr.replace("×", "*").strip()


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_int(value: float) -> bool:
    try:
        return abs(value - round(value)) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _strip_thousands_commas(expr: str) -> str:
    """``1,234,567`` -> ``1234567``; tuple commas (``(1,2)``) stay."""
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
    while True:
        stripped = pattern.sub(r"\1\3\4", expr)
        if stripped == expr:
            return stripped
        expr = stripped


def _str_is_int(text: str) -> bool:
    try:
        return _is_int(float(_strip_thousands_commas(text)))
    except ValueError:
        return False


def _is_frac(expr: str) -> bool:
    return re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr) is not None


def prm800k_normalize(expr: str) -> str:
    """PRM800K's normal form of an answer (units, ``$``, ``%`` dropped; LaTeX as text)."""
    wrapped = _TEXT_WRAPPED.search(expr)
    if wrapped is not None:
        expr = wrapped.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , ")):
        expr = expr.replace(old, new)
    expr = expr.replace(" and ", " , ")
    for word, power in (("million", "6"), ("billion", "9"), ("trillion", "12")):
        expr = expr.replace(word, f"*10^{power}")
    for pattern in _UNIT_PATTERNS:
        expr = pattern.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(round(float(expr)))
    if "\\" in expr:
        with contextlib.suppress(Exception):  # pylatexenc gives up: keep the LaTeX as it is
            expr = _latex_to_text(expr)
    expr = re.sub("- *", "-", expr)  # "- 3" -> "-3" (mixed numbers with a sign)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # mixed number "7 3/4" -> "7+3/4"
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _may_evaluate(expr: str) -> bool:
    """PRM800K's guard before handing ``expr`` to sympy."""
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    if len(letters) > 2 or any(bad in expr for bad in _BAD_SUBSTRINGS):
        return False
    return all(regex.search(expr) is None for regex in _BAD_REGEXES)


class _SympyTimeout(Exception):
    """A sympy comparison ran past :data:`SYMPY_TIMEOUT_S`."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`_SympyTimeout` after ``seconds`` (SIGALRM; only on the main thread).

    verl forks a child per comparison instead; the scoring worker is already a separate process
    under the reward manager's per-sample limit, so same value, no fork per sample.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signals need the main thread; the reward manager's own limit still applies
        return

    def expire(signum: int, frame: object) -> None:
        raise _SympyTimeout(f"sympy comparison exceeded {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    try:  # the timer starts inside the try: an alarm that fires at once still restores `previous`
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def equal_under_sympy(truth: str, given: str, timeout_s: float = SYMPY_TIMEOUT_S) -> bool:
    """``sympy.simplify((truth) - (given)) == 0``, guarded as PRM800K does; False on any failure."""
    expr = f"({truth})-({given})"
    if not _may_evaluate(expr):
        return False
    from sympy import simplify
    from sympy.parsing import sympy_parser

    transformations = sympy_parser.standard_transformations + (
        sympy_parser.implicit_multiplication_application,
    )
    try:
        with _time_limit(timeout_s):
            parsed = sympy_parser.parse_expr(
                expr.replace("^", "**"), transformations=transformations
            )
            return bool(simplify(parsed) == 0)
    except Exception:  # noqa: BLE001 -- unparsable, unsimplifiable or too slow: not equal, as in verl
        return False


def _split_tuple(expr: str) -> list[str]:
    """Elements of a tuple/interval ``(a, b]``; a one-element list for anything else."""
    expr = _strip_thousands_commas(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if (
        len(expr) > 2
        and expr[0] in _TUPLE_CHARS
        and expr[-1] in _TUPLE_CHARS
        and not any(ch in inner for ch in _TUPLE_CHARS)
    ):
        return [elem.strip() for elem in inner.split(",")]
    return [expr]


def _elements_equal(truth: str, given: str) -> bool:
    if _is_frac(truth) and _is_frac(given):
        return truth == given  # an unreduced fraction is not the reduced one
    if _str_is_int(truth) != _str_is_int(given):
        return False  # an integer answer must match as an integer, not after simplification
    return equal_under_sympy(truth, given)


def grade_answer(given: str, truth: str) -> bool:
    """PRM800K's verdict: equal normal forms, or equal under sympy element by element.

    Equal after the Hendrycks-MATH normaliser (the very function verl's copy is), or after
    PRM800K's own (:func:`prm800k_normalize`: units, ``\\text{}``, ``%``/``$`` dropped, LaTeX
    as text, lower case, integers canonical), or, element by element of a tuple/interval, under
    ``sympy.simplify`` with PRM800K's guards (no more than two distinct letters, no
    ``^{``/``^(``/large powers; unreduced fractions and integers must match as strings).
    """
    if normalize_answer(truth) == normalize_answer(given):
        return True
    truth_norm, given_norm = prm800k_normalize(truth), prm800k_normalize(given)
    if truth_norm == given_norm:
        return True
    if not given_norm:
        return False
    truth_elems, given_elems = _split_tuple(truth_norm), _split_tuple(given_norm)
    if len(truth_elems) != len(given_elems):
        return False
    if len(truth_elems) > 1 and (
        truth_norm[0] != given_norm[0] or truth_norm[-1] != given_norm[-1]
    ):
        return False  # (a, b) is not [a, b]
    return all(_elements_equal(t, g) for t, g in zip(truth_elems, given_elems, strict=True))


# -- the scorer -------------------------------------------------------------------------------


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the extracted answer grades equal to ``ground_truth``, else 0.0 (verl returns
    ``(correct, format_ok, extracted)`` and its router keeps ``float(correct)``)."""
    solution_str, ground_truth = str(solution_str), str(ground_truth)
    answer = extract_answer(solution_str)
    if grade_answer(answer, ground_truth):
        return 1.0
    return 1.0 if pi_aware_math_equal(answer, ground_truth) else 0.0
