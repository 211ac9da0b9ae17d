"""Start a local torch.distributed world from one process, when no launcher started one.

A command such as ``megarl convert --tp 2`` is run once by the user; when it is not already one
rank of a torchrun / Slurm world, it calls :func:`run_local_world` to start the ranks itself::

    if world_size > 1 and not inside_launched_world():
        results = run_local_world(rank_main, world_size, (args,))

Each rank is a fresh ``spawn``-context process with torchrun's variables set (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so the
rank code initialises ``torch.distributed`` exactly as under torchrun (``env://``). Spawned
children re-import the function by name: it must live at the top level of an importable module
(not in ``__main__`` behind the guard, not a lambda), and its arguments and return value must be
picklable (return CPU tensors or plain values).

A rank fails by raising (``sys.exit(n)`` included). The other ranks are then stopped before the
failing one is: none of them crashes on a vanished peer and buries the failing rank's error
under its own traceback.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

__all__ = ["WorkerError", "free_port", "inside_launched_world", "run_local_world"]


class WorkerError(RuntimeError):
    """A rank of :func:`run_local_world` raised, or died without a result.

    ``str(err)`` is one line: ``rank R: ExceptionType: message`` (or ``rank R exited with code
    N``). ``error`` is the rank's exception, re-created in the launcher (None when it died or its
    exception cannot be pickled); ``traceback`` is the rank's formatted traceback ("" if none).
    """

    def __init__(
        self, rank: int, message: str, error: BaseException | None = None, tb: str = ""
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.error = error
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

    Returns the ranks' return values in rank order, once every rank has exited. Raises
    :class:`WorkerError` for the first rank that raises (``SystemExit`` included) or dies
    without a result (e.g. killed); every rank has been stopped by then. ``fn`` joins the world
    with ``torch.distributed.init_process_group()`` (or
    :func:`megarl.parallel.init.init_distributed`): the environment says where it is.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = multiprocessing.get_context("spawn")
    port = master_port or free_port(master_addr)
    procs: list[multiprocessing.process.BaseProcess] = []
    pipes: dict[Connection, int] = {}
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
        p = ctx.Process(target=_rank_main, args=(fn, tuple(args), env, theirs), name=f"rank{rank}")
        p.start()
        theirs.close()
        procs.append(p)
        pipes[ours] = rank
    try:
        results = _collect(procs, pipes)
        for p in procs:  # let them finish their exit (flushing output, ending helpers)
            p.join()
        return results
    finally:
        _stop(procs)  # after a failure or an interrupt; nothing left to stop otherwise
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
                kind, payload = ready.recv()
            except EOFError:
                _died(procs, rank)
            if kind == "ok":
                results[rank] = payload
                continue
            # Stop the healthy ranks first, then the failing one (it waits for that).
            _stop([p for r, p in enumerate(procs) if r != rank])
            _stop([procs[rank]])
            raise _worker_error(rank, *payload)
    return [results[rank] for rank in range(len(procs))]


def _died(procs: list, rank: int) -> NoReturn:
    """Raise for a rank that ended without a report (killed, or exited in start-up)."""
    _stop(procs)
    code = procs[rank].exitcode
    raise WorkerError(rank, f"rank {rank} exited with code {code} without a result")


def _worker_error(rank: int, line: str, pickled: bytes | None, tb: str) -> WorkerError:
    error = None
    if pickled is not None:
        try:
            error = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - e.g. a class the launcher cannot import
            error = None
    return WorkerError(rank, f"rank {rank}: {line}", error, tb)


def _stop(procs: Sequence) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join()


def _rank_main(fn: Callable[..., Any], args: tuple, env: dict[str, str], conn: Connection) -> None:
    """Body of each spawned rank: run ``fn`` and report its result or its error."""
    os.environ.update(env)
    try:
        result = fn(*args)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the launcher raises it
        text = str(exc).strip()
        line = type(exc).__name__ + (f": {text.splitlines()[0]}" if text else "")
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pickled: bytes | None = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - unpicklable exception: the line and traceback do
            pickled = None
        conn.send(("error", (line, pickled, traceback.format_exc())))
        # Wait until the launcher has stopped the peers and terminates this process (or goes
        # away itself: then the pipe closes). No interpreter shutdown: peers may be gone.
        try:
            conn.recv()
        except (EOFError, OSError):
            pass
        os._exit(1)
    conn.send(("ok", result))
    conn.close()
