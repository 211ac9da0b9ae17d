"""Run one generated Python program on one test input in an isolated child process.

The scoring worker never executes generated code itself. :func:`run_program` writes the program
to a fresh temporary directory and runs ``python -I -X utf8 -c <driver>`` there, in its own
process group (killed as a whole after every run, so loops and forked children do not outlive
their test), under rlimits (:func:`_child_limits`) and a minimal environment, inside the OS
sandbox of :mod:`.sandbox` (no network, the system read-only, only that directory writable, no
other processes; ``reward.code_sandbox=false`` leaves it out). The driver (:data:`_DRIVER`)
reproduces what verl 0.9.1's ``prime_code`` gives a program: its reliability guard,
star-imports and recursion limit. The expected outputs never enter the child.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from megarl.reward.scorers import sandbox

__all__ = [
    "OUTPUT_LIMIT_BYTES",
    "ChildRun",
    "Run",
    "driver_script",
    "program_stdin",
    "run_child",
    "run_of_exit",
    "run_program",
]

OUTPUT_LIMIT_BYTES = 64 * 2**20
"""Largest output file a program may write (RLIMIT_FSIZE; past it the program is killed)."""

COMPILE_ERROR, RUNTIME_ERROR = 3, 4
"""Driver exit codes (0: the program ran to its end)."""

_GUARDED_OS_NAMES = (
    "kill system putenv remove removedirs rmdir fchdir setuid fork forkpty killpg rename renames "
    "truncate replace unlink fchmod fchown chmod chown chroot lchflags lchmod lchown getcwd chdir"
)
"""``os`` functions verl's reliability guard sets to None."""
_STAR_IMPORTS_NAMES = (
    "string re datetime collections heapq bisect copy math random statistics itertools "
    "functools operator io sys json builtins typing"
)
"""Modules verl star-imports ahead of a program, in its order (builtins last but one)."""
_GUARDED_OS = tuple(_GUARDED_OS_NAMES.split())
_STAR_IMPORTS = tuple(_STAR_IMPORTS_NAMES.split())
_PRELUDE = (
    "".join(f"from {name} import *\n" for name in _STAR_IMPORTS)
    + "import "
    + ", ".join(name for name in _STAR_IMPORTS if name not in ("builtins", "typing"))
    + "\nsys.setrecursionlimit(6 * 10**5)\n"
)

_DRIVER = f"""
import builtins, json, os, shutil, sys, traceback

def guard():
    # verl's reliability_guard: the same calls fail for the same programs.
    builtins.exit = builtins.quit = builtins.help = None
    for name in {_GUARDED_OS!r}:
        setattr(os, name, None)
    shutil.rmtree = shutil.move = shutil.chown = None
    for name in ("ipdb", "joblib", "resource", "psutil", "tkinter", "subprocess", "ctypes"):
        sys.modules[name] = None

def to_text(result):
    import ast
    json.dumps(result)  # verl rejects a result JSON cannot encode
    text = repr(result)
    try:
        ast.literal_eval(text)
        return "r" + text
    except Exception:
        return "j" + json.dumps(result)

def main(mode, fn_name, load_only, source):
    if source is None:
        with open("solution.py", encoding="utf-8") as f:
            source = f.read()
    call_input = sys.stdin.read() if mode == "call" else ""
    result_fd = os.dup(1)
    if mode == "call":  # the program's own output is discarded, its result goes to result_fd
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    guard()
    scope = {{"__name__": "__main__" if mode == "stdin" else "solution", "__builtins__": builtins}}
    exec({_PRELUDE!r}, scope)
    try:
        code = compile(source, "<solution>", "exec")
        if mode == "call":
            exec(code, scope)
            fn = getattr(scope["Solution"](), fn_name) if "class Solution" in source else scope[fn_name]
    except BaseException:
        traceback.print_exc()
        return {COMPILE_ERROR}
    if load_only:
        return 0
    if mode == "stdin":
        try:
            exec(code, scope)
        except SystemExit:
            pass
        except BaseException:
            traceback.print_exc()
            return {RUNTIME_ERROR}
        return 0
    for raw in json.loads(call_input):
        try:
            args = [json.loads(line) for line in raw.split("\\n")]
            if isinstance(args[0], dict):  # verl: JSON keys back to ints, only this argument kept
                try:
                    args = [{{int(k): v for k, v in args[0].items()}}]
                except Exception:
                    pass
            text = to_text(fn(*args))
        except BaseException:
            traceback.print_exc()
            return {RUNTIME_ERROR}
        os.write(result_fd, (text + "\\n").encode("utf-8", "backslashreplace"))
    return 0

status = main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", globals().get("SOURCE"))
for stream in (sys.stdout, sys.__stdout__):
    try:
        stream.flush()
    except BaseException:
        pass
os._exit(status)  # no atexit handlers or thread joins of the program's
"""


@dataclass(frozen=True)
class Run:
    """What became of one run of a program."""

    status: str
    """``"ok"``, ``"compile_error"``, ``"runtime_error"`` or ``"timeout"``."""
    output: str = ""
    """stdin mode: the program's stdout; call mode: one line per input, ``"r" + repr`` or
    ``"j" + JSON`` of the function's result (up to the first failing call)."""


def run_program(
    source: str,
    test_input: str | list[str],
    *,
    fn_name: str | None,
    timeout_s: float,
    memory_limit_mb: int,
    load_only: bool = False,
) -> Run:
    """Run ``source`` in an isolated child (see the module docstring).

    ``fn_name`` None: a stdin/stdout program, ``test_input`` its stdin text; it runs as
    ``__main__`` and ``sys.exit`` ends it normally. Otherwise the function to call once per text
    in the list ``test_input`` (its lines are the JSON arguments), in one process as verl's
    all-tests check does: the program is loaded as a module (a method of ``Solution()`` when it
    defines ``class Solution``), its own output discarded, and each result goes back through a
    private copy of fd 1 (one ``json.dumps`` rejects is a runtime error, as in verl).
    ``load_only``: stop after compiling (and loading the module and finding the function).
    stdin comes from the test input, stdout goes to a file, stderr is discarded.
    """
    argv = [sys.executable, "-I", "-X", "utf8", "-c", _DRIVER, *driver_args(fn_name, load_only)]
    child = run_child(
        argv,
        {"solution.py": source},
        program_stdin(test_input, fn_name),
        timeout_s=timeout_s,
        memory_limit_mb=memory_limit_mb,
    )
    return run_of_exit(child.finished, child.returncode, child.stdout)


def driver_args(fn_name: str | None, load_only: bool) -> list[str]:
    """The driver's arguments: mode, function name, load-only flag."""
    return ["stdin" if fn_name is None else "call", fn_name or "", str(int(load_only))]


def program_stdin(test_input: str | list[str], fn_name: str | None) -> str:
    """The driver's stdin: the test input (stdin mode) or the call inputs as JSON."""
    return test_input if fn_name is None else json.dumps(test_input)


def driver_script(source: str, fn_name: str | None, load_only: bool) -> str:
    """The driver as one self-contained script holding ``source`` (for a remote sandbox, which
    runs it as ``python <file>`` with the test input on stdin): the same program, guard and
    exit codes as :func:`run_program`'s child, stdin and stdout read and written as UTF-8."""
    prefix = (
        "import sys\n"
        f"sys.argv[1:] = {driver_args(fn_name, load_only)!r}\n"
        "for _stream in (sys.stdin, sys.stdout):\n"
        "    _stream.reconfigure(encoding='utf-8', errors='surrogateescape')\n"
        f"SOURCE = {source!r}\n"
    )
    return prefix + _DRIVER


def run_of_exit(finished: bool, returncode: int | None, stdout: str) -> Run:
    """The :class:`Run` of a driver that ``finished`` (in time) with ``returncode``."""
    if not finished:
        return Run("timeout")
    status = {0: "ok", COMPILE_ERROR: "compile_error"}.get(returncode, "runtime_error")
    return Run(status, stdout if status == "ok" else "")


@dataclass(frozen=True)
class ChildRun:
    """What became of one child process."""

    finished: bool
    """Whether it exited within its wall-time limit."""
    returncode: int | None
    stdout: str
    stderr: str = ""
    """Only with ``keep_stderr`` (otherwise discarded)."""


def run_child(
    argv: list[str],
    files: dict[str, str],
    stdin_text: str,
    *,
    timeout_s: float,
    memory_limit_mb: int,
    keep_stderr: bool = False,
) -> ChildRun:
    """Run ``argv`` in a fresh temporary directory holding ``files`` (name -> text), under the
    limits and the OS sandbox of the module docstring; stdin ``stdin_text``, stdout (and with
    ``keep_stderr`` stderr) read from files of at most :data:`OUTPUT_LIMIT_BYTES`."""
    sandboxed = sandbox.enabled()
    if sandboxed:
        sandbox.require_sandbox()
    with tempfile.TemporaryDirectory(prefix="megarl-code-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        for name, text in files.items():
            (work / name).write_text(text, encoding="utf-8", errors="surrogatepass")
        (work / "stdin.txt").write_text(stdin_text, encoding="utf-8", errors="surrogatepass")
        with (
            open(work / "stdin.txt", "rb") as stdin,
            open(work / "stdout.txt", "wb") as stdout,
            open(work / "stderr.txt", "wb") if keep_stderr else nullcontext() as stderr,
        ):
            if sandboxed:
                argv = sandbox.sandbox_argv(argv, tmp)
            proc = subprocess.Popen(
                argv,
                cwd=work,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr if keep_stderr else subprocess.DEVNULL,
                env=_child_env(sandbox.SCRATCH if sandboxed else tmp),
                start_new_session=True,
                # a scoring worker is single-threaded: preexec_fn is safe there
                preexec_fn=_child_limits(timeout_s, memory_limit_mb, sandboxed),  # noqa: PLW1509
            )
        finished = _exited_within(proc.pid, timeout_s)
        _kill_group(proc.pid)  # the leader is not reaped yet, so the group id is still ours
        returncode = proc.wait()
        out, err = (_read(work / name) for name in ("stdout.txt", "stderr.txt"))
    return ChildRun(finished, returncode, out, err if keep_stderr else "")


def _read(path: Path) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        return f.read(OUTPUT_LIMIT_BYTES).decode("utf-8", "replace")


def _child_env(tmp: str) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TMPDIR": tmp}
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = "1"
    return env


_PR_SET_PDEATHSIG = 1
_LIBC = (
    ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None
)


def _child_limits(timeout_s: float, memory_limit_mb: int, sandboxed: bool = False):
    """The ``preexec_fn`` of a program's child: rlimits and the parent-death signal.

    Address space ``memory_limit_mb``, CPU seconds a little past the wall limit, output file
    size :data:`OUTPUT_LIMIT_BYTES`, no core files; on Linux SIGKILL when the parent dies, so the
    program dies with a scoring worker the reward pool kills. Sandboxed as root: at most
    :data:`~.sandbox.MAX_PROCESSES` tasks (binding once the sandbox drops root's uid).
    """
    nproc = sandboxed and os.geteuid() == 0
    memory = memory_limit_mb * 2**20
    cpu = int(timeout_s) + 2

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT_LIMIT_BYTES, OUTPUT_LIMIT_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if nproc:
            limit = sandbox.MAX_PROCESSES
            resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return apply


def _exited_within(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` (our unreaped child) exits within ``timeout_s`` seconds."""
    fd = os.pidfd_open(pid)
    try:
        readable, _, _ = select.select([fd], [], [], timeout_s)
    finally:
        os.close(fd)
    return bool(readable)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
