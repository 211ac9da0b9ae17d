"""Start a local torch.distributed world from one process, when no launcher started one.

A command such as ``megarl convert --tp 2`` that is not already one rank of a torchrun / Slurm
world starts its ranks itself::

    if world_size > 1 and not inside_launched_world():
        results = run_local_world(rank_main, world_size, (args,))

Each rank is a fresh ``spawn`` process with torchrun's variables set, so it initialises
``torch.distributed`` exactly as under torchrun. Nothing of the world outlives
:func:`run_local_world`; reports travel as JSON, never pickles, so the launcher executes nothing
a rank sends.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NoReturn

from megarl.parallel.fast_exit import exit_process

__all__ = ["WorkerError", "free_port", "inside_launched_world", "run_local_world"]

STOP_GRACE_S = 10.0
"""How long a stopped rank's process group has between SIGTERM and SIGKILL."""


class WorkerError(RuntimeError):
    """A rank of :func:`run_local_world` raised, or died without a result.

    ``str(err)`` is one line: ``rank R: ExceptionType: message`` (or ``rank R exited with code
    N ...``). ``error_type`` names the rank's exception class ("" when it died) and ``detail``
    is the first line of its message; ``exit_code`` is the code of a rank that called
    ``sys.exit(N)`` with an int (else None); ``traceback`` is the rank's formatted traceback ("" if
    none).
    """

    def __init__(
        self,
        rank: int,
        message: str,
        *,
        error_type: str = "",
        detail: str = "",
        exit_code: int | None = None,
        tb: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.detail = detail
        self.exit_code = exit_code
        self.traceback = tb


def inside_launched_world() -> bool:
    """True in a rank started by torchrun (``RANK``/``WORLD_SIZE`` set) or a multi-task srun."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_local_world(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` new local processes forming one world.

    Returns the ranks' return values (JSON round-tripped) in rank order, once every rank has
    exited. Raises :class:`WorkerError` for the first rank that raises (``SystemExit``
    included) or dies without a result (e.g. killed); every rank and every process a rank
    started has been stopped by then, as after an exception in the launcher (Ctrl-C). ``fn``
    joins the world with ``torch.distributed.init_process_group()`` (or
    :func:`megarl.parallel.init.init_distributed`): the environment says where it is.

    ``fn`` is re-imported by name in each rank: it must live at the top level of an importable
    module (not in ``__main__`` behind the guard, not a lambda), with picklable arguments and a
    JSON return value (numbers, strings, lists, dicts: ``tensor.tolist()``). A rank ends with
    ``os._exit`` once it has reported, so ``fn`` must close what it writes before it returns. When
    a rank fails, the others are stopped before it, so none buries its error under a traceback
    about a vanished peer. Each rank leads its own process group (the processes it starts, e.g.
    the dist-checkpoint writer, are stopped with it, even once orphaned), and a rank whose
    launcher dies gets SIGTERM (``PR_SET_PDEATHSIG``).

    Without ``master_port`` a free port is picked; another process may take it before rank 0's
    store binds it (a shared machine). A world whose rank 0 fails to bind the picked port
    (``EADDRINUSE``, before ``fn`` has done anything) is started again on a new port, up to
    :data:`PORT_ATTEMPTS` times in all.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = master_port or free_port(master_addr)
        try:
            return _run_world(fn, world_size, tuple(args), master_addr, port)
        except WorkerError as err:
            if master_port is not None or attempt == PORT_ATTEMPTS or not _port_taken(err, port):
                raise
    raise AssertionError("unreachable")


PORT_ATTEMPTS = 3
"""Worlds started in all when the picked rendezvous port is taken before rank 0 binds it."""


def _port_taken(err: WorkerError, port: int) -> bool:
    """Whether ``err`` is rank 0's store failing to bind ``port`` (torch's DistNetworkError:
    "... port: P, useIpv6: ..., name: EADDRINUSE ...")."""
    detail = err.detail or ""
    return err.rank == 0 and "EADDRINUSE" in detail and f"port: {port}," in detail


def _run_world(
    fn: Callable[..., Any], world_size: int, args: tuple, master_addr: str, port: int
) -> list[Any]:
    """One start of :func:`run_local_world`'s world on ``port``."""
    ctx = multiprocessing.get_context("spawn")
    procs: list[multiprocessing.process.BaseProcess] = []
    pipes: dict[Connection, int] = {}
    try:
        for rank in range(world_size):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(port),
            }
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(fn, args, env, theirs), name=f"rank{rank}")
            p.start()
            theirs.close()
            procs.append(p)
            pipes[ours] = rank
        results = _collect(procs, pipes)
        for p in procs:  # let them finish their exit (flushing output, ending helpers)
            p.join()
        return results
    finally:
        # After a failure or an interrupt: the ranks and whatever they started. After success:
        # only helpers a rank left behind (none, normally).
        _stop(procs)
        for conn in pipes:
            conn.close()


def _collect(procs: list, pipes: dict[Connection, int]) -> list[Any]:
    """Wait for every rank's report; on the first failure stop the world and raise."""
    results: dict[int, Any] = {}
    pending = dict(pipes)
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    while pending:
        for ready in wait([*pending, *sentinels]):
            if ready in sentinels:
                # Ended. Its report (or the EOF of its pipe) is normally readable now; if not,
                # a child of it still holds the pipe open, and the exit code must do.
                rank = sentinels.pop(ready)
                conn = next((c for c, r in pending.items() if r == rank), None)
                if conn is not None and not conn.poll():
                    _died(procs, rank)
                continue
            rank = pending.pop(ready)
            try:
                report = json.loads(ready.recv_bytes())
            except (EOFError, OSError):
                _died(procs, rank)
            if report["kind"] == "ok":
                results[rank] = report["result"]
                continue
            # Stop the healthy ranks first, then the failing one (it waits for that).
            _stop([p for r, p in enumerate(procs) if r != rank])
            _stop([procs[rank]])
            raise WorkerError(
                rank,
                f"rank {rank}: {report['type']}"
                + (f": {report['detail']}" * bool(report["detail"])),
                error_type=report["type"],
                detail=report["detail"],
                exit_code=report["exit_code"],
                tb=report["traceback"],
            )
    return [results[rank] for rank in range(len(procs))]


def _died(procs: list, rank: int) -> NoReturn:
    """Raise for a rank that ended without a report (killed, or exited in start-up)."""
    _stop(procs)
    code = procs[rank].exitcode
    raise WorkerError(rank, f"rank {rank} exited with code {code} without a result")


def _stop(procs: Sequence) -> None:
    """Stop each rank's whole process group: SIGTERM, then SIGKILL after ``STOP_GRACE_S``.

    A rank leads its group (its pid is the group id), and the group outlives the rank while
    any process of it lives, so this also ends helpers orphaned by an earlier exit.
    """
    groups = [p.pid for p in procs if p.pid is not None]
    for p in procs:  # a rank stopped before it made its group has only itself to stop
        if p.is_alive():
            p.terminate()
    for pgid in groups:
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for pgid in groups:
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)  # no handle to wait on for a group's non-child members
        _signal_group(pgid, signal.SIGKILL)
    for p in procs:
        if p.is_alive():
            p.kill()
        if p.pid is not None:
            p.join()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is gone
        pass


def _group_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` runs. Zombies do not count: an orphaned helper's
    is reaped by init whenever init gets to it, not by us."""
    proc = Path("/proc")
    if not proc.is_dir():  # no procfs: the group as the kernel sees it, zombies included
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        state, _ppid, group = stat.rpartition(")")[2].split()[:3]
        if int(group) == pgid and state != "Z":
            return True
    return False


def _die_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when its parent (the launcher) dies."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # no prctl: the launcher's _stop must do
        return
    if os.getppid() == 1:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _send_report(conn: Connection, kind: str, **fields: Any) -> None:
    conn.send_bytes(json.dumps({"kind": kind, **fields}).encode())


def _rank_main(fn: Callable[..., Any], args: tuple, env: dict[str, str], conn: Connection) -> None:
    """Body of each spawned rank: run ``fn`` and report its result or its error."""
    os.setpgid(0, 0)  # lead a group holding everything this rank starts (see _stop)
    _die_with_parent()
    os.environ.update(env)
    try:
        result = fn(*args)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the launcher raises it
        text = str(exc).strip()
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else None
        sys.stdout.flush()
        sys.stderr.flush()
        _send_report(
            conn,
            "error",
            type=type(exc).__name__,
            detail=text.splitlines()[0] if text else "",
            exit_code=code,
            traceback=traceback.format_exc(),
        )
        # Wait until the launcher has stopped the peers and terminates this process (or goes
        # away itself: then the pipe closes). No interpreter shutdown: peers may be gone.
        try:
            conn.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    _send_report(conn, "ok", result=result)
    conn.close()
    # Done: skip the interpreter's shutdown (1-2 s of tearing down torch and Megatron that the
    # launcher would wait for), but run the atexit handlers: multiprocessing's finalizers
    # among them remove the rank's ``pymp-*`` directory (left in TMPDIR by every rank of every
    # conversion before). ``fn`` closed what it wrote; helpers it left (a checkpoint writer's
    # manager) are in this rank's process group, which the launcher stops.
    exit_process(0)
