"""A pool of scoring worker processes with a per-sample time limit.

The limit runs from the moment a sample is handed to a ready worker (start-up and the scorer's
imports never count); a worker still busy when it runs out is killed and replaced and the sample
reported as timed out, and a worker that dies by itself is replaced and its sample reported as an
error. Each worker is a fresh interpreter (``python -c``, the parent's ``sys.path``) that imports
only :mod:`megarl.reward.worker` and its scorer: nothing is forked from a process holding GPU
memory or threads, and the trainer's ``__main__`` is not re-imported. Each runs in a session of
its own (torchrun's ``killpg`` of a stopping rank cannot take it mid-step) and dies with its
rank (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Self

from megarl.reward.loader import ScorerSpec

__all__ = ["Outcome", "ScoringPool", "Task"]

START_TIMEOUT_S = 120.0
"""How long a new worker may take to start and load its scorer (not counted in the limit)."""

Task = tuple[int, str, str, Any, Any]
"""(index, data_source, solution_str, ground_truth, extra_info)."""


@dataclass
class Outcome:
    """What became of one sample: a score, a timeout, or an error."""

    index: int
    status: str
    """"ok", "timeout" or "error"."""
    score: float = 0.0
    fields: dict[str, Any] | None = None
    message: str = ""


_BOOT = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from megarl.reward.worker import serve_fd, die_with_parent; "
    "die_with_parent(int(sys.argv[4])); serve_fd(int(sys.argv[2]), sys.argv[3])"
)


class _Worker:
    """One scoring process: a fresh interpreter talking over a socket pair."""

    def __init__(self, spec_json: str) -> None:
        parent, child = socket.socketpair()
        # Its own temporary directory, removed when it stops: a worker killed over its time
        # limit cannot remove what it was using (the code scorer's sandbox directory).
        self.tmp = tempfile.mkdtemp(prefix="megarl-scorer-")
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-c", _BOOT, json.dumps(sys.path), str(child.fileno()),
                    spec_json, str(os.getpid()),
                ],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "TMPDIR": self.tmp},
                start_new_session=True,  # out of reach of torchrun's killpg of the rank
            )  # fmt: skip
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.ready = False
        self.task: Task | None = None
        self.deadline = 0.0

    def stop(self, kill: bool) -> None:
        if not kill:
            try:
                self.conn.send(None)
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop(kill=w.task is not None)
    workers.clear()


class ScoringPool:
    """``num_workers`` scoring processes running ``spec`` with ``timeout_s`` per sample."""

    def __init__(self, spec: ScorerSpec, num_workers: int = 1, timeout_s: float = 30.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.spec, self.timeout_s = spec, float(timeout_s)
        self._spec_json = json.dumps({**asdict(spec), "reward_kwargs": dict(spec.reward_kwargs)})
        self._workers: list[_Worker] = [self._start_worker() for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers."""
        return [w.proc.pid for w in self._workers if w.proc.pid is not None]

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(self, tasks: list[Task]) -> list[Outcome]:
        """Score ``tasks``; one :class:`Outcome` per task, in the order given.

        A worker found dead while idle is replaced before it is given a sample, and a sample
        whose worker was killed by a signal (not by its sample) is scored once more on a fresh
        worker.
        """
        if not self._finalizer.alive:
            raise RuntimeError("the scoring pool is closed")
        pending: deque[Task] = deque(tasks)
        done: dict[int, Outcome] = {}
        retried: set[int] = set()
        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for slot, w in enumerate(list(self._workers)):
                if w.ready and w.task is None and w.proc.poll() is not None:
                    w.stop(kill=True)  # died while idle (a signal meant for the rank): replace
                    self._workers[slot] = w = self._start_worker()
                if w.ready and w.task is None and pending:
                    w.task, w.deadline = pending.popleft(), now + self.timeout_s
                    w.conn.send(w.task)
            watched = [w for w in self._workers if w.task is not None or not w.ready]
            wait_s = max(0.0, min(w.deadline for w in watched) - time.monotonic())
            readable = set(wait([w.conn for w in watched], timeout=wait_s))
            for slot, w in enumerate(list(self._workers)):
                if not w.ready:
                    if self._check_start(w, w.conn in readable):  # killed by a signal
                        w.stop(kill=True)
                        self._workers[slot] = self._start_worker()
                    continue
                if w.task is None:
                    continue
                if w.conn in readable:
                    outcome = self._receive(w)
                elif time.monotonic() >= w.deadline:
                    outcome = Outcome(
                        w.task[0], "timeout", message=f"exceeded {self.timeout_s:g} s"
                    )
                else:
                    continue
                killed = outcome.status == "error" and (w.proc.poll() or 0) < 0
                if killed and outcome.index not in retried:
                    retried.add(outcome.index)  # killed by a signal, not by its sample: again
                    pending.appendleft(w.task)
                else:
                    done[outcome.index] = outcome
                if outcome.status == "ok" or outcome.status == "error" and w.proc.poll() is None:
                    w.task = None
                else:  # timed out or died: kill, reap and replace
                    w.stop(kill=True)
                    self._workers[slot] = self._start_worker()
        return [done[t[0]] for t in tasks]

    def _start_worker(self) -> _Worker:
        w = _Worker(self._spec_json)
        w.deadline = time.monotonic() + START_TIMEOUT_S
        return w

    def _check_start(self, w: _Worker, readable: bool) -> bool:
        """A starting worker reports ready (its scorer loaded) before the clock runs for it;
        True when a signal killed it on the way (replace it), raises when it failed."""
        if readable:
            try:
                reply = w.conn.recv()
            except (EOFError, OSError):
                if (code := w.proc.wait()) < 0:
                    return True
                reply = ("failed", f"it exited with code {code}")
            if reply[0] == "ready":
                w.ready = True
                return False
            problem = reply[1]
        elif time.monotonic() >= w.deadline:
            problem = f"it was not ready after {START_TIMEOUT_S:g} s"
        else:
            return False
        self.close()
        raise RuntimeError(f"a scoring worker for {self.spec.label} failed to start: {problem}")

    def _receive(self, w: _Worker) -> Outcome:
        index = w.task[0]  # type: ignore[index]
        try:
            reply = w.conn.recv()
        except (EOFError, OSError):
            try:
                code = w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            return Outcome(index, "error", message=f"the scoring worker died (exit code {code})")
        if reply[0] == "ok":
            return Outcome(index, "ok", score=reply[2], fields=reply[3])
        return Outcome(index, "error", message=reply[2])
