"""Where trainer checkpoints live and which of them count: verl's layout, made crash-safe.

::

    <trainer.default_local_dir>/
        latest_checkpointed_iteration.txt   the step of the newest complete checkpoint
        global_step_<N>/                    actor/, critic/ (Megatron dist checkpoints),
                                            trainer_state.json, config.yaml, COMPLETE (last)
        global_step_<N>.tmp/                being written, or left by a crash: never resumed

A save writes into the ``.tmp`` directory; :func:`commit` writes ``COMPLETE``, renames it into
place and only then rewrites the pointer file, so a crash leaves the previous complete
checkpoint and the pointer to it intact. Plain file work (no torch): the pre-flight uses it too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

POINTER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
EXTRA_STATE_FILE = "extra_state.json"
HF_FILES_DIR = "hf_files"
"""Beside a model's shards: the source's config, tokenizer and generation files."""
META_FORMAT = "megarl-gpt/1"
HF_EXPORT_DIR = "huggingface"
TMP_SUFFIX = ".tmp"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
TMP_DIR = re.compile(r"^global_step_(\d+)\.tmp$")
ROLES = ("actor", "critic")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed (one line naming the path or key)."""


def step_dir(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/global_step_<step>``."""
    return Path(run_dir) / f"global_step_{step}"


def tmp_dir(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/global_step_<step>.tmp``: where a save writes before the rename."""
    return Path(run_dir) / f"global_step_{step}{TMP_SUFFIX}"


def is_complete(path: str | Path) -> bool:
    """True for a ``global_step_<N>`` directory that a finished save renamed into place."""
    path = Path(path)
    return bool(STEP_DIR.match(path.name)) and (path / COMPLETE_MARKER).is_file()


def step_of(path: str | Path) -> int:
    """N of ``global_step_<N>`` (or of its ``.tmp``)."""
    m = STEP_DIR.match(Path(path).name) or TMP_DIR.match(Path(path).name)
    if m is None:
        raise CheckpointError(f"{path} is not a global_step_<N> checkpoint directory")
    return int(m.group(1))


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete ``global_step_<N>`` directories of ``run_dir``, oldest first."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=step_of)


def incomplete_checkpoints(run_dir: str | Path) -> list[Path]:
    """``.tmp`` directories and ``global_step_<N>`` directories without ``COMPLETE``."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and (TMP_DIR.match(p.name) or (STEP_DIR.match(p.name) and not is_complete(p)))
    ]
    return sorted(found, key=step_of)


def read_pointer(run_dir: str | Path) -> int | None:
    """The step in ``latest_checkpointed_iteration.txt`` (None when absent or unreadable)."""
    try:
        return int((Path(run_dir) / POINTER_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def write_pointer(run_dir: str | Path, step: int) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``step`` atomically."""
    root = Path(run_dir)
    tmp = root / f".{POINTER_FILE}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(f"{step}\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, root / POINTER_FILE)
    _fsync_dir(root)


def latest_complete(run_dir: str | Path, warn: Callable[[str], None]) -> Path | None:
    """The checkpoint ``resume_mode=auto`` resumes from: the pointer's, else the newest complete.

    Warns (naming them) about incomplete directories, and when the pointer names a checkpoint
    that is not there.
    """
    partial = incomplete_checkpoints(run_dir)
    if partial:
        names = ", ".join(str(p) for p in partial)
        warn(
            f"skipping incomplete checkpoint director{'ies' if len(partial) > 1 else 'y'}: {names}"
        )
    complete = complete_checkpoints(run_dir)
    pointed = read_pointer(run_dir)
    if pointed is not None:
        target = step_dir(run_dir, pointed)
        if is_complete(target):
            return target
        warn(f"{Path(run_dir) / POINTER_FILE} names step {pointed}, which is not complete")
    return complete[-1] if complete else None


def resolve_resume_path(path: str | Path) -> Path:
    """``trainer.resume_from_path``: a ``global_step_<N>`` directory, or a run directory (its
    latest complete checkpoint). Raises ``CheckpointError`` naming the path."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"trainer.resume_from_path={path}: no such directory")
    if STEP_DIR.match(p.name):
        if not is_complete(p):
            raise CheckpointError(
                f"trainer.resume_from_path={path} is an incomplete checkpoint (no {COMPLETE_MARKER})"
            )
        return p.resolve()
    found = latest_complete(p, lambda _message: None)
    if found is None:
        raise CheckpointError(
            f"trainer.resume_from_path={path} holds no complete global_step_<N> checkpoint"
        )
    return found.resolve()


def commit(tmp: Path, final: Path, run_dir: Path) -> None:
    """Mark ``tmp`` complete, rename it to ``final`` and point the run at it (rank 0 only)."""
    marker = tmp / COMPLETE_MARKER
    with open(marker, "w", encoding="utf-8") as fh:
        json.dump({"step": step_of(final)}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():  # a step saved twice (e.g. resumed at it): the new save replaces it
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(run_dir)
    write_pointer(run_dir, step_of(final))


def apply_retention(run_dir: str | Path, keep: dict[str, int | None]) -> list[Path]:
    """Delete the oldest complete checkpoints of each role beyond ``keep[role]`` (None: all).

    Only complete checkpoints count and only older ones are deleted, so this runs after a newer
    checkpoint is complete. A step directory left with no model is removed whole. Returns what
    was deleted.
    """
    deleted: list[Path] = []
    complete = complete_checkpoints(run_dir)
    for role, limit in keep.items():
        if limit is None:
            continue
        holding = [p for p in complete if (p / role).is_dir()]
        for old in holding[: max(len(holding) - limit, 0)]:
            shutil.rmtree(old / role)
            deleted.append(old / role)
    for path in complete:
        if not any((path / role).is_dir() for role in ROLES):
            shutil.rmtree(path)
            deleted.append(path)
    return deleted


def read_json(path: Path) -> dict:
    """A JSON file of a checkpoint; ``CheckpointError`` naming it when missing or broken."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as JSON (rank 0 calls this inside the ``.tmp`` directory)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)
