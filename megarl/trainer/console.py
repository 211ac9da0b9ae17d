"""A quiet console: megarl's own lines on the terminal, everything else in the run's log file.

vLLM, Megatron, transformers and their C++ parts print INFO lines and warnings on every rank;
users read them as faults. Unless ``verbose``, file descriptors 1 and 2 of every rank are
redirected into ``<run dir>/logs/rank<r>.log`` (so C++ output goes there too), and rank 0 keeps
a handle on the original terminal for megarl's own lines and its progress bar.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Self, TextIO


class Console:
    """Rank 0's terminal while third-party output goes to a log file."""

    def __init__(self, log_dir: Path, *, rank: int, verbose: bool = False) -> None:
        self.rank = rank
        self.verbose = verbose
        self.log_path = Path(log_dir) / f"rank{rank}.log"
        self._saved: list[int] = []
        self.out: TextIO = sys.stdout

    def __enter__(self) -> Self:
        if self.verbose:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = [os.dup(1), os.dup(2)]
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        self.out = os.fdopen(os.dup(self._saved[0]), "w", buffering=1)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._saved:
            return
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self._saved = []
        with contextlib.suppress(Exception):
            self.out.close()
        self.out = sys.stdout

    def print(self, message: str) -> None:
        """A megarl line on the terminal (rank 0), and in the log file."""
        if self.rank == 0:
            print(message, file=self.out, flush=True)
        if self._saved:
            print(message, flush=True)

    def error(self, message: str) -> None:
        """An error line on every rank's terminal stderr (and in its log file)."""
        target = os.fdopen(os.dup(self._saved[1]), "w") if self._saved else sys.stderr
        print(message, file=target, flush=True)
        if self._saved:
            target.close()
            print(message, flush=True)
