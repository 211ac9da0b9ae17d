"""Failure markers: how a rank that is not the logging rank gets FAILED recorded in bounded time.

A rank that raises calls ``Tracker.fail(exc)``, which writes ``<run dir>/failed/rank-<r>`` (one
line: ``rank r: Type: message``) before the process dies. The logging rank's sender thread polls
that directory about once a second, independent of the training loop (which may be stuck in a
collective), and ends the MLflow run FAILED as soon as a marker appears. Files, not a collective
(exactly what hangs when a rank dies) nor MLflow from every rank: the run directory is shared by
every node anyway. A rank clears its own marker when its tracker starts, so a relaunch does not
inherit the last launch's failure; a rank killed by a signal writes none.
"""

from __future__ import annotations

import os
from pathlib import Path

from megarl.tracking.paths import FAILED_DIR


def marker_path(run_dir: Path, rank: int) -> Path:
    """Where ``rank`` records its failure."""
    return Path(run_dir) / FAILED_DIR / f"rank-{rank}"


def describe(exc: BaseException, rank: int) -> str:
    """One line naming the rank and the exception: ``rank 1: ValueError: bad batch``."""
    message = " ".join(str(exc).split())
    return f"rank {rank}: {type(exc).__name__}" + (f": {message}" if message else "")


def write_marker(run_dir: Path, rank: int, line: str) -> None:
    """Record ``rank``'s failure (atomically: the watcher never reads half a line)."""
    path = marker_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(line[:2000] + "\n")
    os.replace(tmp, path)


def clear_marker(run_dir: Path, rank: int) -> None:
    """Remove ``rank``'s marker left by an earlier launch."""
    marker_path(run_dir, rank).unlink(missing_ok=True)


def read_markers(run_dir: Path) -> dict[int, str]:
    """Every failure recorded in ``run_dir``: rank → its line."""
    found: dict[int, str] = {}
    directory = Path(run_dir) / FAILED_DIR
    try:
        entries = list(directory.glob("rank-*"))
    except OSError:
        return found
    for path in entries:
        try:
            found[int(path.name.removeprefix("rank-"))] = path.read_text().strip()
        except (OSError, ValueError):
            continue
    return found
