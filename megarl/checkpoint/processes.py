"""Processes kept from outliving whoever started them: Megatron's checkpoint writers, the ranks.

Megatron's ``torch_dist`` save forks one writer process per file bucket during every save; a
rank killed by SIGKILL would leave them orphaned, holding the checkpoint files open. Every
process forked during a save (:func:`saving`) gets ``PR_SET_PDEATHSIG`` = SIGKILL, so the kernel
kills it with the rank (Linux only; elsewhere only the orderly shutdown remains). The writers'
results reach the rank through a queue: Megatron makes a ``spawn``-context
``multiprocessing.Manager`` for it, a process that re-imports the rank's main module (about 3 s
of a tiny run's 3.5 s save, per rank, on 2 cores) and must itself be kept from outliving the
rank. Saves here are synchronous (``checkpoint.async_save`` is refused): the queue is put to and
read by the rank's own thread, so :func:`start_writer_processes` gives Megatron a plain
``queue.Queue`` before it makes its Manager.

A rank arms the same signal against torchrun (:func:`megarl.trainer.start`), which can die
before the rank has run a line; the launcher therefore names torchrun's pid in
``MEGARL_TORCHRUN_PID`` (a rank started under another parent exits at once), and during the
pre-flight it adopts orphaned descendants (:func:`adopt_orphans`) so that a refused launch ends
them and waits for them (:func:`end_children`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TORCHRUN_PID_ENV = "MEGARL_TORCHRUN_PID"
TEST_HOOK_ENV = "MEGARL_TEST_SLOW_CHECKPOINT"
TEST_HOOK_DIR = "test_hooks"

_fork_hook_installed = False
_saving = False
_writer_delay_s = 0.0


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (no-op off Linux)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def adopt_orphans(on: bool) -> None:
    """Make this process the child subreaper of its descendants (``on``), or stop being it: a
    descendant whose parent dies then becomes this process's child instead of init's (Linux;
    elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


def child_pids() -> set[int]:
    """The pids of this process's children (live or not yet reaped)."""
    import psutil

    return {p.pid for p in psutil.Process().children()}


def end_children(keep: set[int]) -> None:
    """SIGKILL and reap every child of this process not in ``keep``, until none is left: with
    :func:`adopt_orphans` on, a killed child's own children become children here in turn."""
    while pids := child_pids() - keep:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _after_fork_in_child() -> None:
    if _saving:
        die_with_parent(os.getppid())
        if _writer_delay_s > 0:
            time.sleep(_writer_delay_s)


def start_writer_processes() -> None:
    """Arm the forked writers' death signal and give Megatron a thread queue for their results
    (no Manager process); idempotent."""
    global _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_installed = True
    use_thread_results_queue()


def use_thread_results_queue() -> None:
    """Megatron's write-results queue as a ``queue.Queue``: a synchronous save puts to it and
    reads it in this thread (``write_preloaded_data_multiproc`` runs here; its forked workers
    answer on a queue of their own). Every megarl save calls this first."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def stop_writer_processes() -> None:
    """Drop the results queue (end of the run); a later save makes a new one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = None


@contextlib.contextmanager
def saving(step: int, run_dir: Path, rank: int) -> Iterator[None]:
    """Around one save: forked writers die with this rank (and the test hook applies).

    Test hook: ``MEGARL_TEST_SLOW_CHECKPOINT=<step>:<seconds>[:<rank>]`` makes every writer of
    the save of ``<step>`` (on ``<rank>`` only, if given) sleep ``<seconds>`` before writing, and
    that rank write its PID to ``<run dir>/test_hooks/saving-rank<r>.pid`` first, so a test can
    kill a rank mid-write.
    """
    global _saving, _writer_delay_s
    start_writer_processes()
    _writer_delay_s = _test_delay(step, rank)
    if _writer_delay_s > 0:
        hooks = Path(run_dir) / TEST_HOOK_DIR
        hooks.mkdir(parents=True, exist_ok=True)
        (hooks / f"saving-rank{rank}.pid").write_text(str(os.getpid()))
    _saving = True
    try:
        yield
    finally:
        _saving, _writer_delay_s = False, 0.0


def _test_delay(step: int, rank: int) -> float:
    spec = os.environ.get(TEST_HOOK_ENV, "")
    if not spec:
        return 0.0
    at, seconds, *only = spec.split(":")
    if int(at) != step or (only and int(only[0]) != rank):
        return 0.0
    return float(seconds)
