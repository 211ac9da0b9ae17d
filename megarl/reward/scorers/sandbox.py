"""The OS-level sandbox model-written code runs in (the code scorers, ``PythonTool``).

:func:`sandbox_argv` wraps a child's command line in bubblewrap (Debian's ``bubblewrap``;
``make venv`` installs it): new network, PID, IPC, UTS and cgroup namespaces (no network but a
loopback of its own, no view of other processes), a root of its own holding the system read-only
(``/usr``, ``/etc``, the interpreter's prefixes: never the checkout, the run directory or
checkpoints), ``/proc`` of its PID namespace, a minimal ``/dev``, and one writable directory, the
run's scratch directory, mounted on ``/tmp``. The namespace dies with its launcher.

Process and memory limits are rlimits of the launcher, inherited: address space, CPU seconds,
file size and ``RLIMIT_NPROC`` (:data:`MAX_PROCESSES` tasks, threads included). RLIMIT_NPROC does
not bind root, so as root the program runs as a uid of its own (:func:`_sandbox_uid`, dropped by
``setpriv`` inside the sandbox; unique per run, so runs do not share the count); as another user
bubblewrap makes a user namespace and ``prlimit`` sets the limit inside it, where the count is
the namespace's own. Total memory is at most ``MAX_PROCESSES`` × the address-space limit.

``reward.code_sandbox=false`` (or ``MEGARL_CODE_SANDBOX=0`` in a worker's environment, which
:func:`configure` sets) runs programs without it, under the rlimits and verl's reliability guard
only; a machine that cannot run it otherwise refuses with one line (:func:`sandbox_problem`).
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = [
    "ENV_KEY",
    "MAX_PROCESSES",
    "SCRATCH",
    "SandboxError",
    "configure",
    "enabled",
    "require_sandbox",
    "sandbox_argv",
    "sandbox_problem",
]

ENV_KEY = "MEGARL_CODE_SANDBOX"
"""``0``: run model-written code without the sandbox (``reward.code_sandbox=false``)."""
MAX_PROCESSES = 16
"""Tasks (processes and threads) one program may hold at once (RLIMIT_NPROC)."""
SCRATCH = "/tmp"
"""Where the run's scratch directory appears inside the sandbox (its cwd, HOME and TMPDIR)."""
OPT_OUT = "reward.code_sandbox=false"

_UID_BASE = 2**30
_runs = itertools.count()


class SandboxError(RuntimeError):
    """The machine cannot run the sandbox and the user did not opt out."""


def configure(enable: bool) -> None:
    """Record ``reward.code_sandbox`` in this process's environment (inherited by its workers)."""
    os.environ[ENV_KEY] = "1" if enable else "0"


def enabled() -> bool:
    """Whether model-written code runs sandboxed (the default)."""
    return os.environ.get(ENV_KEY, "1") != "0"


def require_sandbox() -> None:
    """Raise :class:`SandboxError` (one line) when sandboxing is on and the machine lacks it."""
    problem = sandbox_problem() if enabled() else None
    if problem:
        raise SandboxError(
            f"model-written code cannot be sandboxed here: {problem}; install bubblewrap "
            f"(apt-get install bubblewrap, or make venv) or set {OPT_OUT} to run it under rlimits "
            "only (not a security boundary)"
        )


@functools.cache
def sandbox_problem() -> str | None:
    """Why this machine cannot run the sandbox (None: it can). Probed once per process."""
    for tool in ("bwrap", "setpriv" if os.geteuid() == 0 else "prlimit"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    # a scratch directory of its own, handed over as a program's is (TMPDIR may be 0700 root's:
    # the scoring workers' is, and an interpreter under /tmp is reached through it)
    with tempfile.TemporaryDirectory(prefix="megarl-sandbox-probe-") as scratch:
        argv = sandbox_argv([sys.executable, "-I", "-c", "pass"], scratch)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"bwrap did not run ({err})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"a probe run failed: {last}"
    return None


def sandbox_argv(command: list[str], scratch: str) -> list[str]:
    """``command`` wrapped in the sandbox, with the host directory ``scratch`` as its writable
    ``/tmp`` (and working directory). As root, ``scratch`` is handed to the program's uid; the
    caller sets RLIMIT_NPROC (:data:`MAX_PROCESSES`) in the launcher as root."""
    system = _system_binds()
    argv = [
        "bwrap",
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        *system[0],
        "--bind",
        scratch,
        SCRATCH,
        *system[1],  # prefixes under /tmp (a checkout there): above the scratch bind
        "--chdir",
        SCRATCH,
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--remount-ro",
        "/",
    ]
    if os.geteuid() == 0:
        uid = _sandbox_uid()
        for path in (scratch, *(str(p) for p in Path(scratch).iterdir())):
            os.chown(path, uid, uid)
        os.chmod(scratch, 0o711)  # bwrap, root without capabilities, enters it
        # capabilities go; setpriv needs SETUID/SETGID once, and the uid change clears them
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        argv += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        argv += ["--no-new-privs", "--"]
    else:  # bubblewrap makes a user namespace; the count there is the namespace's own
        argv += ["--unshare-user", "--disable-userns", "prlimit", f"--nproc={MAX_PROCESSES}", "--"]
    return argv + command


def _sandbox_uid() -> int:
    """A uid no other run of this machine holds now: pid and a per-process counter."""
    return _UID_BASE + ((os.getpid() % 2**22) << 6) + next(_runs) % 64


@functools.cache
def _system_binds() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """bwrap arguments showing the system read-only: /usr, /etc, the top-level links into /usr
    (merged /usr) and the interpreter's prefixes (a virtualenv and its base), nothing else. Two
    parts: the binds outside :data:`SCRATCH`, and those inside it (an interpreter under /tmp),
    which must come after the scratch bind or it hides them."""
    binds: list[str] = []
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / top
        if path.is_symlink():
            binds += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            binds += ["--ro-bind", str(path), str(path)]
    shown = [Path("/usr"), Path("/etc")]
    exe_dir = Path(os.path.realpath(sys.executable)).parent
    for extra in (Path(sys.prefix), Path(sys.base_prefix), exe_dir):
        extra = Path(os.path.realpath(extra))
        if not any(extra == p or p in extra.parents for p in shown):
            shown.append(extra)
    # a venv is shown at its own path (its bin/python links there), and resolved
    if Path(sys.prefix) != Path(os.path.realpath(sys.prefix)):
        shown.append(Path(sys.prefix))
    scratch = Path(SCRATCH)
    inside: list[str] = []
    parents: set[Path] = set()
    for path in shown:
        part = inside if scratch in path.parents else binds
        part += ["--ro-bind", str(os.path.realpath(path)), str(path)]
        parents |= {p for p in path.parents if p != Path("/")}
    # bwrap gives the directories it makes on the way the host's modes (/root: 0700); the
    # scratch directory keeps its own
    made = {p for p in parents if p != scratch and not any(p == s or s in p.parents for s in shown)}
    for parent in sorted(made, key=lambda p: len(p.parts)):
        part = inside if scratch in parent.parents else binds
        part += ["--chmod", "0755", str(parent)]
    return tuple(binds), tuple(inside)
