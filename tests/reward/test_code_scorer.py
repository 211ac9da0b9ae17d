"""The code scorer (codecontests, apps, codeforces, taco) against verl 0.9.1, and its isolation.

Every expected score in ``CASES`` and ``STDOUT`` is verl 0.9.1's own output on the same inputs,
obtained in a throwaway environment (never part of this repository):

    pip download verl==0.9.1 --no-deps; unzip it; python -m venv /tmp/sc-verl/venv;
    /tmp/sc-verl/venv/bin/pip install numpy
    # a stub package exposing only verl/utils/reward_score (its __init__ needs one decorator,
    # verl.utils.import_utils.deprecated, stubbed as a no-op):
    PYTHONPATH=/tmp/sc-verl/stub /tmp/sc-verl/venv/bin/python run_verl.py
    # run_verl.py called, for each row:
    #   verl.utils.reward_score.default_compute_score("codecontests", response, json.dumps(tests))
    # and, for each STDOUT row, the same with the program
    #   "```python\nimport sys\nsys.stdout.write(<printed>)\n```" and tests
    #   {"inputs": [""], "outputs": [<expected>]}

Only the inputs and the numbers are kept here. The tests after the tables check megarl's own
behaviour: isolation (memory, forked children, a killed scoring worker), the sandbox refusal and
the deliberate differences from verl (named in megarl/reward/scorers/code.py).
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time

import psutil
import pytest

from megarl.reward.loader import ScorerSpec
from megarl.reward.pool import ScoringPool
from megarl.reward.scorers import default_compute_score, scorer_module_for
from megarl.reward.scorers.code import compute_score, stdout_matches
from megarl.reward.scorers.code_runner import run_program


def fence(code: str) -> str:
    return "Here is my solution.\n```python\n" + code.strip("\n") + "\n```"


ADD = "a, b = map(int, input().split())\nprint(a + b)"
T2 = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
T3 = {"inputs": ["1 2\n", "3 4\n", "5 6\n"], "outputs": ["3\n", "7\n", "11\n"]}
CALL = {"fn_name": "add", "inputs": ["1\n2", "3\n4"], "outputs": ["3", "7"]}
ONE = {"inputs": ["\n"], "outputs": ["3\n"]}
NO_INPUT = {"inputs": [""], "outputs": ["1\n2"]}
TWELVE = {"inputs": [f"{i} 1\n" for i in range(12)], "outputs": [f"{i + 1}\n" for i in range(12)]}
LOOPS = {"infinite_loop", "loop_on_one_test"}

# (name, response, tests, verl 0.9.1's score)
CASES = [
    ("stdin_correct", fence(ADD), T2, 1.0),
    ("call_correct", fence("def add(a, b):\n    return a + b"), CALL, 1.0),
    (
        "call_class_solution",
        fence("class Solution:\n    def add(self, a, b):\n        return a + b"),
        CALL,
        1.0,
    ),
    ("wrong_answer", fence("a, b = map(int, input().split())\nprint(a - b)"), T2, 0.0),
    (
        "partial_two_of_three",
        fence("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"),
        T3,
        2 / 3,
    ),
    # verl's per-test pass drops fn_name: no partial credit for call-based problems
    (
        "call_partial_scores_zero",
        fence("def add(a, b):\n    return a + b if a < 3 else 0"),
        CALL,
        0.0,
    ),
    ("syntax_error", fence("a, b = map(int, input().split()\nprint(a + b)"), T2, 0.0),
    (
        "runtime_exception_on_one_test",
        fence("a, b = map(int, input().split())\nprint(a + b if a < 3 else 1 / 0)"),
        T2,
        0.5,
    ),
    ("infinite_loop", fence("while True:\n    pass"), ONE, 0.0),
    (
        "loop_on_one_test",
        fence("a, b = map(int, input().split())\nwhile a > 2:\n    pass\nprint(a + b)"),
        T2,
        0.5,
    ),
    ("huge_allocation", fence("x = [0] * 10**12\nprint(3)"), ONE, 0.0),
    ("sys_exit_after_answer", fence("import sys\nprint(3)\nsys.exit(0)\nprint('junk')"), ONE, 1.0),
    ("sys_exit_1_after_answer", fence("import sys\nprint(3)\nsys.exit(1)"), ONE, 1.0),
    ("builtin_exit_fails", fence("print(3)\nexit()"), ONE, 0.0),  # verl's guard: exit = None
    ("os_system_fails", fence("import os\nos.system('true')\nprint(3)"), ONE, 0.0),
    ("no_code_block_pure_code", ADD, T2, 1.0),
    ("no_code_block_prose", "The answer is to add the two numbers.", T2, 0.0),
    ("several_blocks_last_counts", fence("print('wrong')") + "\nBetter:\n" + fence(ADD), T2, 1.0),
    ("several_blocks_last_wrong", fence(ADD) + "\nOr:\n" + fence("print('wrong')"), T2, 0.0),
    ("py_fence_is_not_python", "```py\nprint(3)\n```", ONE, 0.0),
    ("trailing_whitespace", fence("print('3   ')\nprint()\nprint('  ')"), ONE, 1.0),
    ("trailing_spaces_per_line", fence("print('1 ')\nprint(' 2')"), NO_INPUT, 1.0),
    ("blank_line_inside_output", fence("print(1)\nprint()\nprint(2)"), NO_INPUT, 1.0),
    ("float_close", fence("print(1 / 3)"), {"inputs": [""], "outputs": ["0.333333"]}, 1.0),
    (
        "float_too_far",
        fence("print('%.2f' % (1 / 3))"),
        {"inputs": [""], "outputs": ["0.333333"]},
        0.0,
    ),
    ("floats_on_one_line", fence("print('1.0 2.0')"), {"inputs": [""], "outputs": ["1 2"]}, 0.0),
    ("extra_lines_printed", fence("print('debug')\n" + ADD), T2, 0.0),
    ("empty_response", "", T2, 0.0),
    (
        "twelve_tests_eleventh_wrong",  # only the first ten tests count
        fence("a, b = map(int, input().split())\nprint(a + b if a != 10 else 0)"),
        TWELVE,
        1.0,
    ),
    (
        "twelve_tests_first_wrong",
        fence("a, b = map(int, input().split())\nprint(a + b if a != 0 else 0)"),
        TWELVE,
        0.9,
    ),
    ("ground_truth_not_json", fence(ADD), "not json", 0.0),
    (
        "fewer_outputs_than_inputs",
        fence(ADD),
        {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n"]},
        0.0,
    ),
    (
        "readline_keeps_its_newline",
        fence("import sys\ns = sys.stdin.readline()[:-1]\nprint(len(s))"),
        {"inputs": ["abc\n"], "outputs": ["3"]},
        1.0,
    ),
    (
        "star_imported_names_without_import",
        fence("print(int(sqrt(9)), Counter('aab')['a'])"),
        {"inputs": [""], "outputs": ["3 2"]},
        1.0,
    ),
    (
        "main_guard",
        fence(
            "def main():\n    "
            + ADD.replace("\n", "\n    ")
            + "\n\nif __name__ == '__main__':\n    main()"
        ),
        T2,
        1.0,
    ),
    (
        "call_dict_int_keys",
        fence("def f(n):\n    return {n: n * 2}"),
        {"fn_name": "f", "inputs": ["1"], "outputs": ['{"1": 2}']},
        1.0,
    ),
    (
        "call_tuple_result",
        fence("def f(n):\n    return (n, n + 1)"),
        {"fn_name": "f", "inputs": ["1"], "outputs": ["[1, 2]"]},
        1.0,
    ),
    (
        "call_set_result_fails",  # not JSON-serialisable
        fence("def f(n):\n    return {n}"),
        {"fn_name": "f", "inputs": ["1"], "outputs": ["[1]"]},
        0.0,
    ),
    ("call_prints_noise", fence("def add(a, b):\n    print('noise')\n    return a + b"), CALL, 1.0),
    ("call_name_found_in_star_imports", fence("def plus(a, b):\n    return a + b"), CALL, 1.0),
    ("call_sys_exit_fails", fence("import sys\ndef add(a, b):\n    sys.exit(0)"), CALL, 0.0),
    ("no_tests_compiles", fence("print(1)"), {"inputs": [], "outputs": []}, 1.0),
    ("no_tests_syntax_error", fence("print(1"), {"inputs": [], "outputs": []}, 0.0),
    (
        "list_inputs_fail",
        fence("a = int(input())\nb = int(input())\nprint(a + b)"),
        {"inputs": [["5", "3"]], "outputs": [["8"]]},
        0.0,
    ),
]


@pytest.mark.parametrize(
    ("name", "response", "tests", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_code_scores_match_verl(name, response, tests, expected):
    # Short limits only where the program loops; generous ones elsewhere (a loaded CI machine).
    timeout = 1.0 if name in LOOPS else 60.0
    truth = tests if isinstance(tests, str) else json.dumps(tests)
    score = default_compute_score(
        "codecontests", response, truth, test_timeout_s=timeout, all_tests_timeout_s=timeout
    )
    assert score == pytest.approx(expected)


# (what the program prints, the expected output, verl 0.9.1's score)
STDOUT = [
    ("3\n", "3", 1.0),
    ("3   \n\n", "3", 1.0),
    ("  3\n", "3", 1.0),
    ("1 \n 2\n", "1\n2", 1.0),
    ("1\n\n2\n", "1\n2", 1.0),
    ("1\n2\n", "1\n\n2", 1.0),
    ("1 2\n", "1  2", 0.0),
    ("1\t2\n", "1 2", 0.0),
    ("0.3333333333\n", "0.333333", 1.0),
    ("0.33\n", "0.333333", 0.0),
    ("1.0\n", "1", 1.0),
    ("03\n", "3", 0.0),
    ("-3\n", "-3.0", 1.0),
    ("1e3\n", "1000", 1.0),
    ("100000.1\n", "100000", 1.0),
    ("1.0 2.0\n", "1 2", 0.0),
    ("inf\n", "inf", 1.0),
    ("YES\n", "yes", 0.0),
    ("debug\n3\n", "3", 0.0),
    ("3\nextra\n", "3", 0.0),
    ("", "", 1.0),
    ("", "3", 0.0),
    ("3\r\n", "3", 1.0),
    ("a b\n", "b a", 0.0),
    ("1\n2\n", "1 2", 0.0),
    ("0.1\n0.2\n", "0.1\n0.20000001", 1.0),
]


@pytest.mark.parametrize(("printed", "expected", "verl"), STDOUT)
def test_stdout_comparison_matches_verl(printed, expected, verl):
    assert stdout_matches(printed, expected) == bool(verl)


@pytest.mark.parametrize("source", ["codecontests", "apps", "codeforces", "taco"])
def test_the_four_code_sources_route_to_the_code_scorer(source):
    assert scorer_module_for(source) == "megarl.reward.scorers.code"


def test_deliberate_differences_from_verl():
    """Real-script behaviour where verl's in-process rewrite fails (verl scores both 0.0)."""
    one = json.dumps({"inputs": ["2\n"], "outputs": ["3"]})
    uses_global = "n = int(input())\ndef f():\n    global n\n    return n + 1\nprint(f())"
    assert compute_score(fence(uses_global), one) == 1.0
    assert compute_score(fence("import sys\nsys.stdout.buffer.write(b'3\\n')"), one) == 1.0


def test_the_memory_limit_fails_a_large_allocation():
    program = "x = bytearray(300 * 2**20)\nprint(len(x) // 2**20)"
    small = run_program(program, "", fn_name=None, timeout_s=60, memory_limit_mb=256)
    assert small.status == "runtime_error"
    large = run_program(program, "", fn_name=None, timeout_s=60, memory_limit_mb=1024)
    assert (large.status, large.output) == ("ok", "300\n")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _dies(pid: int) -> bool:
    """Whether ``pid`` is gone (or a zombie) within 30 s: a SIGKILL lands asynchronously."""
    deadline = time.monotonic() + 30  # a timeout, not a timing claim
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _gone(pid)


class _Sleeper(threading.Thread):
    """Finds the host pid of the ``sleep`` a sandboxed program execs (the sandbox shows the
    program its own PID namespace only): its argument is a number no other process uses."""

    def __init__(self):
        super().__init__(daemon=True)
        self.arg = f"600.{random.randrange(10**8):08d}"
        self.code = f"posix.execv('/bin/sleep', ['sleep', {self.arg!r}])"
        self.pid: int | None = None
        self.stop = threading.Event()
        self.start()

    def run(self):
        while self.pid is None and not self.stop.wait(0.05):
            for proc in psutil.process_iter(["cmdline"]):
                if proc.info["cmdline"] == ["sleep", self.arg]:
                    self.pid = proc.pid

    def found(self) -> int:
        self.stop.set()
        self.join()
        assert self.pid is not None, "the program's sleep never ran"
        return self.pid


def test_a_forked_child_does_not_outlive_its_test():
    # os.fork is disabled as in verl; posix.fork is the way round it.
    sleeper = _Sleeper()
    program = f"import posix, time\nif posix.fork() == 0:\n    {sleeper.code}\ntime.sleep(3)"
    run = run_program(program, "", fn_name=None, timeout_s=60, memory_limit_mb=1024)
    assert run.status == "ok"
    assert _dies(sleeper.found())


def test_a_stuck_program_dies_with_a_killed_scoring_worker(tmp_path, monkeypatch):
    """The reward pool kills a worker over its per-sample limit; the program it ran dies too,
    and the sandbox directory it was running in is gone with the worker's own."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    (tmp_path / "tmp").mkdir()
    # sleeping, not spinning: its CPU-time limit never fires, only the parent-death signal
    sleeper = _Sleeper()
    sample = (0, "taco", fence(f"import posix\n{sleeper.code}"), json.dumps(ONE), None)
    with ScoringPool(ScorerSpec(), num_workers=1, timeout_s=3.0) as pool:
        [outcome] = pool.score([sample])
        assert outcome.status == "timeout"
        [ok] = pool.score([(1, "apps", fence(ADD), json.dumps(T2), None)])
        assert (ok.status, ok.score) == ("ok", 1.0)
    assert _dies(sleeper.found())
    assert list((tmp_path / "tmp").iterdir()) == []
