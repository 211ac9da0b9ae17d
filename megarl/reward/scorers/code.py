"""Code generation (``codecontests``, ``apps``, ``codeforces``, ``taco``): run the program on the
ground-truth tests; the score is the fraction of tests passed.

Same semantics as verl 0.9.1's default route for these sources without a sandbox,
``prime_code.compute_score(solution_str, ground_truth, continuous=True)``, written from its
behaviour (rules: :func:`compute_score`). Each test runs in an isolated child process
(:mod:`.code_runner`), where verl runs the program inside its harness's own process; so a stdin
program runs as a real script (``global``, ``sys.stdout.buffer`` and a ``__main__`` block that is
not the last statement work here, verl scores them 0), limits include interpreter start-up, and
memory is capped (``memory_limit_mb``).

With ``sandbox_fusion_url`` (``reward.sandbox_fusion.url``) every run goes to that Sandbox Fusion
service instead (:mod:`.sandbox_fusion`: the same driver, so the same results; a failed call
fails its test, logged in one line). verl's sandbox route scores by its own, stricter rules
(exact stdout after trailing newlines, a function's result printed as JSON); megarl keeps the
rules above either way.
"""

from __future__ import annotations

import ast
import functools
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from megarl.reward.scorers.code_runner import Run, run_program

__all__ = [
    "DATA_SOURCES",
    "call_result_matches",
    "compute_score",
    "extract_code",
    "stdout_matches",
]

DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
CONTINUOUS_TESTS = 10
"""verl's continuous score looks at the first ten tests only."""
TEST_TIMEOUT_S = 10.0
"""Wall-time limit of one test in the per-test pass (verl's continuous pass: 10 s)."""
ALL_TESTS_TIMEOUT_S = 6.0
"""Wall-time limit of a call-based program's all-tests run (verl: 5 s a call, 6 s in all)."""
MEMORY_LIMIT_MB = 1024


@dataclass(frozen=True)
class Tests:
    """The test cases of one problem."""

    inputs: list[Any]
    outputs: list[Any]
    fn_name: str | None


def compute_score(
    solution_str: str,
    ground_truth: Any,
    continuous: bool = True,
    *,
    test_timeout_s: float = TEST_TIMEOUT_S,
    all_tests_timeout_s: float = ALL_TESTS_TIMEOUT_S,
    memory_limit_mb: int | None = None,
    sandbox_fusion_url: str | None = None,
    sandbox_fusion_max_concurrent: int | None = None,
    concurrent_semaphore: AbstractContextManager | None = None,
    **_unused: Any,
) -> float:
    """Fraction of the tests ``solution_str``'s program passes.

    - The program is :func:`extract_code`'s; ``ground_truth`` is ``{"inputs": [...],
      "outputs": [...], "fn_name"?: str}`` or its JSON text; anything else (bad JSON, missing
      keys, fewer outputs than inputs) scores 0, and a test whose input or output is not a
      string fails.
    - Without ``fn_name`` each input is the program's stdin, its stdout compared with the output
      text (:func:`stdout_matches`); the score is the fraction of the **first ten** tests
      passed, each run on its own (verl's all-tests pre-check of stdin programs can only give a
      1.0 these give too, so it is not run).
    - With ``fn_name`` all tests first run in one process (``all_tests_timeout_s`` in all; verl
      also 5 s a call), calling that function (a method of ``Solution()`` when the program
      defines ``class Solution``) with each input's lines JSON-decoded as arguments
      (:func:`call_result_matches`); all pass: 1.0. Otherwise verl's per-test pass runs the
      first ten tests **as stdin programs**, which a function-only program fails: call-based
      problems score 1 or, nearly always, 0.
    - ``continuous=False``: 1.0 when every test passes, else 0.0 (verl 0.9.1 intends this but
      raises ``UnboundLocalError`` on a failure; its default route passes ``continuous=True``).
    - A syntax error (with ``fn_name``: an error loading the module, a missing function) fails
      every test; a runtime error, a timeout or a wrong answer fails its test; ``sys.exit``
      ends a stdin program normally, ``exit()``/``quit()`` fail (verl's guard). No test cases:
      1.0 when the program compiles (and its function loads), as in verl.
    - ``test_timeout_s`` is the per-test wall-time limit; the reward pool's per-sample limit
      applies on top (ten looping tests take ten times ``test_timeout_s``).
    - ``sandbox_fusion_url``: the programs run on that service, at most
      ``sandbox_fusion_max_concurrent`` (64) calls at once on this machine, or under verl's
      ``concurrent_semaphore`` when one is given; a failed call fails its test.
    """
    runner = _runner(sandbox_fusion_url, sandbox_fusion_max_concurrent, concurrent_semaphore)
    tests = parse_tests(ground_truth)
    if tests is None:
        return 0.0
    source = extract_code(solution_str)
    memory = {"memory_limit_mb": memory_limit_mb or MEMORY_LIMIT_MB}
    # verl's getattr fails on a fn_name that is not text: no function loads.
    name_ok = tests.fn_name is None or isinstance(tests.fn_name, str)
    if not tests.inputs:
        if not name_ok:
            return 0.0
        run = runner(
            source, "", fn_name=tests.fn_name, load_only=True, timeout_s=test_timeout_s, **memory
        )
        return 1.0 if run.status == "ok" else 0.0
    if tests.fn_name is not None:
        calls = {"timeout_s": all_tests_timeout_s, **memory}
        if name_ok and _all_calls_pass(runner, source, tests, **calls):
            return 1.0
        if not continuous:
            return 0.0
    count = min(len(tests.inputs), CONTINUOUS_TESTS) if continuous else len(tests.inputs)
    passed = 0
    for test_input, expected in zip(tests.inputs[:count], tests.outputs, strict=False):
        # verl's per-test pass drops fn_name: a call-based program is run as a stdin program.
        limits = {"timeout_s": test_timeout_s, **memory}
        verdict = _stdin_test(runner, source, test_input, expected, **limits)
        if verdict == "compile_error" or (verdict == "fail" and not continuous):
            break
        passed += verdict == "pass"
    return passed / count if continuous else float(passed == count)


def extract_code(completion: str) -> str:
    """The program in ``completion``: the text after the last `````python`` up to the next
    ````` (without `````python``: the text up to the first `````), verl's rule."""
    return completion.split("```python")[-1].split("```")[0]


def parse_tests(ground_truth: Any) -> Tests | None:
    """The tests in ``ground_truth`` (a dict or its JSON text); None when malformed."""
    if not isinstance(ground_truth, dict):
        try:
            ground_truth = json.loads(ground_truth)
        except (TypeError, ValueError):
            return None
    if not isinstance(ground_truth, dict):
        return None
    inputs, outputs = ground_truth.get("inputs"), ground_truth.get("outputs")
    if not isinstance(inputs, list | tuple) or not isinstance(outputs, list | tuple):
        return None
    if len(outputs) < len(inputs):
        return None
    return Tests(list(inputs), list(outputs), ground_truth.get("fn_name"))


def _runner(
    url: str | None, max_concurrent: int | None, semaphore: AbstractContextManager | None
) -> Callable[..., Run]:
    """:func:`run_program`, or its run on the Sandbox Fusion service at ``url``."""
    if not url:
        return run_program
    from megarl.reward.scorers import sandbox_fusion

    client = sandbox_fusion.client_for(url, max_concurrent or sandbox_fusion.DEFAULT_MAX_CONCURRENT)
    return functools.partial(sandbox_fusion.run_program_remote, client, semaphore=semaphore)


def _all_calls_pass(runner: Callable[..., Run], source: str, tests: Tests, **limits: Any) -> bool:
    """Whether every call-based test passes, all run in one process as verl's pre-check does."""
    run = runner(source, tests.inputs, fn_name=tests.fn_name, **limits)
    if run.status != "ok":
        return False
    results = run.output.split("\n")[: len(tests.inputs)]
    if len(results) < len(tests.inputs):
        return False
    return all(
        isinstance(expected, str) and call_result_matches(_decode_result(text), expected)
        for text, expected in zip(results, tests.outputs, strict=False)
    )


def _stdin_test(
    runner: Callable[..., Run], source: str, test_input: Any, expected: Any, **limits: Any
) -> str:
    """``"pass"``, ``"fail"`` or ``"compile_error"`` (which fails every test) for one test."""
    if not isinstance(test_input, str) or not isinstance(expected, str):
        return "fail"  # verl's harness asserts text (its truncation helper) and fails the test
    run = runner(source, test_input, fn_name=None, **limits)
    if run.status == "compile_error":
        return "compile_error"
    return "pass" if run.status == "ok" and stdout_matches(run.output, expected) else "fail"


def stdout_matches(output: str, expected: str) -> bool:
    """Whether a program's stdout ``output`` passes for the ``expected`` text (verl's rules).

    Accepted when any holds: the texts are equal after stripping both ends (also with every
    output line stripped); the output lines equal the expected text's non-empty lines, each
    stripped (also after dropping empty output lines); or, line for line, every pair converts
    with ``float`` and is close (``rtol=1e-5, atol=1e-8``), unless every pair is all digits. No
    token-level comparison: ``"1 2"`` never matches ``"1  2"`` and ``"1.0 2.0"`` never ``"1 2"``.
    """
    lines = output.splitlines()
    want = expected.strip()
    if "\n".join(lines).strip() == want or "\n".join(s.strip() for s in lines).strip() == want:
        return True
    expected_lines = [line.strip() for line in expected.split("\n") if line]
    if lines == expected_lines:
        return True
    lines = [line for line in lines if line]
    if lines == expected_lines:
        return True
    return _floats_close(lines, expected_lines)


def _floats_close(lines: list[str], expected_lines: list[str]) -> bool:
    if len(lines) != len(expected_lines):
        return False
    if all(a.isdigit() and b.isdigit() for a, b in zip(lines, expected_lines, strict=True)):
        return False
    try:
        pairs = [(float(a), float(b)) for a, b in zip(lines, expected_lines, strict=True)]
    except ValueError:
        return False
    return all(a == b or abs(a - b) <= 1e-8 + 1e-5 * abs(b) for a, b in pairs)


def _decode_result(text: str) -> Any:
    """A call-based result as the child sent it (``"r"`` + repr, or ``"j"`` + JSON)."""
    try:
        return ast.literal_eval(text[1:]) if text.startswith("r") else json.loads(text[1:])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _UNDECODABLE


_UNDECODABLE = object()


def call_result_matches(result: Any, expected_json: str) -> bool:
    """Whether a function's ``result`` passes for the JSON text ``expected_json`` (verl's rules).

    The expected value is JSON-decoded; a JSON object becomes a one-element list holding it with
    integer keys (as does a list starting with an object). A tuple result counts as a list.
    Accepted when the result equals the expected value, or its first element when that is a
    non-empty list, or (for a result of tuples) the tuples as lists equal that first element.
    """
    try:
        expected = _int_keyed(json.loads(expected_json))
    except (TypeError, ValueError, RecursionError):
        return False
    if isinstance(result, tuple):
        result = list(result)
    matched = result == expected
    if isinstance(expected, list) and expected:
        matched = matched or result == expected[0]
    try:
        if isinstance(result[0], tuple):
            matched = matched or [list(x) for x in result] == expected[0]
    except (LookupError, TypeError, ValueError):
        pass
    return matched is True


def _int_keyed(expected: Any) -> Any:
    """verl's undoing of JSON's string keys: ``{"1": v}`` -> ``[{1: v}]``."""
    if isinstance(expected, dict):
        try:
            expected = [{int(k): v for k, v in expected.items()}]
        except (TypeError, ValueError):
            pass
    try:
        if isinstance(expected[0], dict):
            expected = [{int(k): v for k, v in expected[0].items()}]
    except (LookupError, TypeError, ValueError):
        pass
    return expected
