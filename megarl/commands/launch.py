"""Run torchrun on this machine for ``megarl train``, the quickstart and each node of a Slurm job:
the outside of the stop protocol, and one line for a failure inside the ranks.

- **Stops.** torchrun runs in a session of its own and is never signalled by the first stop: a
  SIGTERM, SIGUSR1 or SIGINT writes ``<run dir>/STOP`` and every rank saves the step in flight
  and exits 0 (:mod:`megarl.checkpoint.stop`). A second signal stops now: torchrun gets SIGINT.
  (torchrun would die of SIGUSR1, and kills its ranks 30 s after a SIGTERM.)
- **Nothing left running or behind.** Parent-death signals chain launcher → torchrun → ranks →
  scoring workers and checkpoint writers (:func:`megarl.trainer.start` arms the ranks'); torchrun
  and the ranks get a ``TMPDIR`` of their own, removed at exit.
- **Checked while the ranks start.** With ``preflight``, the ranks import and wait at a gate
  (:mod:`megarl.parallel.gate`) until the checks pass. A problem ends torchrun and its ranks
  and waits for them: the ranks run in sessions of their own, and one that torchrun started
  just before it was killed has not armed its parent-death signal yet, so meanwhile this
  process adopts orphans (:func:`megarl.checkpoint.processes.adopt_orphans`) and kills and
  reaps each before it returns; a rank that finds its torchrun gone exits at once.
- **One line.** torchrun's output goes to ``<run dir>/logs/torchrun.log``; a failure is the
  first rank's ``error:`` line (exit 2 for an input error, else 1), a rank killed by a signal is
  named.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from megarl.checkpoint.processes import TORCHRUN_PID_ENV, adopt_orphans, child_pids, end_children
from megarl.parallel.gate import GATE_ENV, open_gate
from megarl.tracking.paths import STOP_FILE

EXIT_INPUT_ERROR = 2
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
LOG_NAME = "torchrun.log"

# Started as ``python -c _EXEC_DYING_WITH_PARENT <launcher pid> <argv...>``: set the parent-death
# signal, then become torchrun (the setting survives exec; no preexec_fn in a threaded parent),
# telling the ranks its pid: a rank whose parent is not that process exits (megarl.trainer.start).
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "    if os.getppid() != int(sys.argv[1]):\n"
    "        os._exit(1)\n"
    f"os.environ[{TORCHRUN_PID_ENV!r}] = str(os.getpid())\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)
_FAILURE = re.compile(
    r"host\s*: (?P<host>\S+)\s*\n\s*rank\s*: (?P<rank>\d+).*\n"
    r"\s*exitcode\s*: (?P<code>-?\d+) \(pid: (?P<pid>\d+)\)(?:\s*\((?P<signal>SIG\w+)\))?"
)
_SHOWN = ("megarl:", "warning:")
_EXCEPTION = re.compile(r"^(?!.*ChildFailedError)[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b")


def torchrun_command(
    nproc: int,
    module: str,
    args: list[str],
    *,
    rendezvous: tuple[int, str, str] | None = None,
) -> list[str]:
    """``python -m torch.distributed.run`` running ``module`` with ``args``: ``--standalone``,
    or one node of ``rendezvous`` = (nodes, c10d endpoint ``HOST:PORT``, rendezvous id)."""
    where = ["--standalone"]
    if rendezvous is not None:
        nnodes, endpoint, rdzv_id = rendezvous
        where = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                 f"--rdzv-id={rdzv_id}"]  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run", *where,
        "--nproc_per_node", str(nproc), "-m", module, *args,
    ]  # fmt: skip


def node_name() -> str:
    """This node's name: Slurm's (``%N`` in its file patterns), else the short host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def run_torchrun(
    command: list[str],
    env: dict[str, str],
    run_dir: Path,
    *,
    log_path: Path | None = None,
    preflight: Callable[[], str | None] | None = None,
    training_ranks: int | None = None,
    first_teacher_rank: int | None = None,
    **popen,
) -> int:
    """Run ``command`` (torchrun) as described in the module docstring; its exit status.
    torchrun's output goes to ``log_path`` (default ``<run dir>/logs/torchrun.log``).
    ``training_ranks``: with vLLM on ranks of its own, how many ranks train (the ones after
    them are rollout ranks, which a failure line says); ``first_teacher_rank``: where the
    distillation teacher's ranks begin (the last ones), if any.

    ``preflight`` (the run's checks: the first problem as one line, or None) runs here while the
    ranks start and import; they wait at a gate (:mod:`megarl.parallel.gate`) until it has
    passed. A problem is printed as ``error: ...`` with exit 2; torchrun is killed before a rank
    has done anything (nothing written, not even the log)."""
    scratch, env = scratch_env(env)
    try:
        roles = (training_ranks, first_teacher_rank)
        return _supervise(command, env, Path(run_dir), log_path, preflight, scratch, roles, popen)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def scratch_env(env: dict[str, str], prefix: str = "megarl-launch-") -> tuple[str, dict[str, str]]:
    """A new temporary directory for a launch and ``env`` with ``TMPDIR`` pointing there;
    Inductor's cache stays in its usual place (``TORCHINDUCTOR_CACHE_DIR``, unless ``env`` sets
    it), so later launches still find it. The caller removes the directory."""
    scratch = tempfile.mkdtemp(prefix=prefix)
    inductor = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return scratch, {"TORCHINDUCTOR_CACHE_DIR": inductor, **env, "TMPDIR": scratch}


def _supervise(
    command: list[str],
    env: dict[str, str],
    run_dir: Path,
    log_path: Path | None,
    preflight: Callable[[], str | None] | None,
    scratch: str,
    roles: tuple[int | None, int | None],
    popen: dict,
) -> int:
    """:func:`run_torchrun` inside its temporary directory ``scratch`` (the gate's too)."""
    log_path = Path(log_path) if log_path is not None else run_dir / "logs" / LOG_NAME
    stop_file = run_dir / STOP_FILE
    verbose = env.get("MEGARL_VERBOSE", "0") not in ("", "0")
    gate_dir = scratch if preflight is not None else None
    others: set[int] = set()  # children this process had before: not this launch's
    if gate_dir is not None:
        env = {**env, GATE_ENV: os.path.join(gate_dir, "go")}
        others = child_pids()
        adopt_orphans(True)  # until the gate opens or the launch ends (_open_gate)
    else:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    child = subprocess.Popen(
        [sys.executable, "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *command[1:]],
        env=env,
        stderr=subprocess.PIPE,
        start_new_session=True,
        **popen,
    )
    if gate_dir is not None:
        try:
            problem = _open_gate(child, preflight, gate_dir, others)
        except _Stopped as stopped:
            name = signal.Signals(stopped.signum).name
            print(
                f"megarl: {name} received during the pre-flight: stopped, nothing ran",
                file=sys.stderr,
            )
            return 128 + stopped.signum
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return EXIT_INPUT_ERROR
        log_path.parent.mkdir(parents=True, exist_ok=True)
    requested: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if not requested:
            stop_file.write_text(f"{name} to megarl train\n")  # the ranks' stop line names it
            note = "the run stops after the step in flight with a checkpoint (again: now, unsaved)"
            os.write(2, f"megarl: {name} received: {note}\n".encode())
        else:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGINT)
        requested.append(name)

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    errors: list[str] = []
    try:
        with open(log_path, "a", encoding="utf-8", errors="replace") as log:
            assert child.stderr is not None
            for raw in child.stderr:
                line = raw.decode(errors="replace")
                log.write(line)
                log.flush()
                if verbose:
                    sys.stderr.write(line)
                elif line.startswith("error:"):
                    errors.append(line.strip())
                elif line.startswith(_SHOWN) and not line.startswith("megarl: failed after"):
                    sys.stderr.write(line)
                    sys.stderr.flush()
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if requested:
        stop_file.unlink(missing_ok=True)  # honoured, or the run ended first: not for the next
    if code == 0:
        return 0
    if len(requested) > 1:
        where = f"logs: {log_path.parent}"
        print(f"megarl: stopped at once without saving ({requested[1]}; {where})", file=sys.stderr)
        return 128 + signal.Signals[f"{requested[1]}"].value
    summary, code = _failure_summary(log_path, errors, code, *roles)
    print(summary, file=sys.stderr)
    return code


class _Stopped(BaseException):
    """A stop signal during the pre-flight (nothing has run: stop at once)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _open_gate(child: subprocess.Popen, preflight, gate_dir: str, others: set[int]) -> str | None:
    """Run ``preflight`` while ``child`` (torchrun) starts; on a problem (or an exception, Ctrl-C
    included) kill it and its ranks and reap them (every child but ``others``, the ones this
    process had before), else let the ranks through (:mod:`megarl.parallel.gate`). The problem
    or None."""
    problem: str | None = "the pre-flight did not finish"

    def stop(signum: int, _frame: object) -> None:
        raise _Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        problem = preflight()
        if problem is None:
            open_gate(os.path.join(gate_dir, "go"))
        return problem
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if problem is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            # The ranks are orphans now, adopted here: armed ones die of their parent-death
            # signal, one not yet armed is killed; each is reaped before the launcher returns.
            end_children(others)
            assert child.stderr is not None
            child.stderr.close()
        adopt_orphans(False)


def _failure_summary(
    log_path: Path,
    errors: list[str],
    code: int,
    training_ranks: int | None = None,
    first_teacher_rank: int | None = None,
) -> tuple[str, int]:
    """(the one line to print, the exit status) for a failed torchrun; ``training_ranks``,
    ``first_teacher_rank``: see :func:`run_torchrun`."""
    text = log_path.read_text(errors="replace")
    failures = list(_FAILURE.finditer(text))
    where = f"logs: {log_path.parent}"
    # A rank the OS or an operator killed (not torchrun's own SIGTERM to the survivors): name it,
    # rather than the survivors' "Connection closed by peer". torchrun's report lists the other
    # failures first and its root cause (the first failure) last; a survivor it SIGKILLed after
    # its grace period also shows SIGKILL, so the root cause of the last report comes first.
    root = text.rfind("Root Cause (first observed failure)")
    failures.sort(key=lambda f: not (0 <= root < f.start()))  # stable: else in log order
    killed = [
        f for f in failures if int(f["code"]) < 0 and f["signal"] not in ("SIGTERM", "SIGINT")
    ]
    if killed:
        f = killed[0]
        role = ""
        if training_ranks is not None:  # vLLM on ranks of its own: say which kind died
            rank = int(f["rank"])
            role = ", a rollout rank (vLLM)" if rank >= training_ranks else ", a training rank"
            if first_teacher_rank is not None and rank >= first_teacher_rank:
                role = ", a distillation teacher's rank (vLLM)"
        line = (
            f"error: rank {f['rank']} (pid {f['pid']}{role}) on {f['host']} died of "
            f"{f['signal'] or _signal_name(-int(f['code']))}; the run ended ({where})"
        )
        return line, 1
    status = EXIT_INPUT_ERROR if any(int(f["code"]) == EXIT_INPUT_ERROR for f in failures) else 1
    if errors:
        first = errors[0]
        return (first if "details:" in first else f"{first} ({where})"), status
    if code < 0:
        return f"error: torchrun ended by {_signal_name(-code)} ({where})", 1
    # No error: line (a rank died before its console was up): the last exception line.
    raised = [ln.strip() for ln in text.splitlines() if _EXCEPTION.match(ln)]
    last = raised[-1] if raised else "no exception in the log"
    return f"error: the ranks failed ({last}; {where})", status


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
