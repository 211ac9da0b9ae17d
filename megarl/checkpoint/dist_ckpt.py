"""Megatron distributed checkpoints of model chunks (the on-disk format used on GPU too).

``dist_checkpointing`` stores each tensor under its global key with its global shape, so a
checkpoint saved at one TP×PP(×VPP) loads at any other; chunks are stored as ``model{i}`` with
global layer indices, so the nesting does not tie a checkpoint to a VPP size. The ``torch_dist``
save's results queue is a thread queue
(:func:`megarl.checkpoint.processes.use_thread_results_queue`), not the ``spawn``-context
Manager Megatron would start, whose child re-imports the launching script (3 s per save, and a
hang where an entry point does its work outside ``if __name__ == "__main__":``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megarl.checkpoint.meta import META_FILE, read_checkpoint_meta
from megarl.checkpoint.processes import use_thread_results_queue
from megarl.models.gpt import unwrap

__all__ = [
    "META_FILE",
    "CheckpointError",
    "CheckpointMismatchError",
    "load_model_checkpoint",
    "read_checkpoint_meta",
    "save_model_checkpoint",
]


class CheckpointError(ValueError):
    """A directory that is not a readable checkpoint; the message names it."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint whose tensors do not fit the model; the message names the keys."""


HOLD_SAVE_ENV = "MEGARL_TEST_HOLD_SAVE"
"""Test hook: when set to a directory, each checkpoint writer process creates a file there and
then waits (600 s) before writing, so that a test can interrupt a save in progress."""


def _hold_writers(marker_dir: Path) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    write = FileSystemWriterAsync.write_preloaded_data

    def held_write(*args, **kwargs):  # runs in the forked writer process
        (marker_dir / f"writer-{os.getpid()}").touch()
        time.sleep(600)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(held_write)


def _sharded_state_dict(
    chunks: Sequence[torch.nn.Module], skip: tuple[str, ...] = (), *, adapters_only: bool = False
) -> dict:
    from megarl.models.lora import is_adapter_param

    return {
        f"model{i}": {
            k: v
            for k, v in unwrap(c).sharded_state_dict().items()
            if not k.startswith(skip) and (is_adapter_param(k) or not adapters_only)
        }
        for i, c in enumerate(chunks)
    }


def save_model_checkpoint(
    chunks: Sequence[torch.nn.Module], ckpt_dir: str | Path, *, meta: dict | None = None
) -> Path:
    """Save this rank's shards of ``chunks`` into ``ckpt_dir`` (collective over all ranks).

    ``meta`` (JSON-serialisable: HF config, step, layout) is written by rank 0 beside the shards.
    """
    path = Path(ckpt_dir)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if os.environ.get(HOLD_SAVE_ENV):
        _hold_writers(Path(os.environ[HOLD_SAVE_ENV]))
    use_thread_results_queue()
    dist_checkpointing.save(_sharded_state_dict(chunks), str(path))
    # Written after the shards: Megatron treats extra files in the directory before a save as
    # the remains of an incomplete checkpoint.
    if dist.get_rank() == 0 and meta is not None:
        (path / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    dist.barrier()
    return path


def load_model_checkpoint(
    chunks: Sequence[torch.nn.Module],
    ckpt_dir: str | Path,
    *,
    skip: tuple[str, ...] = (),
    adapters_only: bool = False,
) -> None:
    """Load ``ckpt_dir`` (saved at any parallel layout) into this rank's ``chunks``.

    ``skip``: prefixes of state-dict keys left as they are (the critic's value head, when its
    initial weights come from an actor's checkpoint); tensors of the checkpoint that the model
    does not ask for are ignored, as Megatron ignores them. ``adapters_only``: read the LoRA
    adapters alone (a LoRA actor's checkpoint holds no base; ``chunks`` carry it already).

    Raises :class:`CheckpointError` naming the directory when it is not a checkpoint or a shard
    cannot be read, :class:`CheckpointMismatchError` naming keys when it holds another model.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(ckpt_dir)
    if not (path / "metadata.json").exists():
        raise CheckpointError(f"not a Megatron distributed checkpoint (no metadata.json): {path}")
    try:
        wanted = _sharded_state_dict(chunks, skip, adapters_only=adapters_only)
        state = dist_checkpointing.load(wanted, str(path))
    # torch's CheckpointException is a BaseException: it escapes `except Exception`
    except (CheckpointException, CheckpointingException) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {_first_failure(exc)}") from None
    for i, chunk in enumerate(chunks):
        missing, unexpected = unwrap(chunk).load_state_dict(state[f"model{i}"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state") and not k.startswith(skip)]
        if adapters_only:
            missing = [k for k in missing if k in wanted[f"model{i}"]]
        if missing or unexpected:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )


def _first_failure(exc: BaseException) -> str:
    """One line for torch's ``CheckpointException`` (it maps ranks to their exceptions)."""
    failures = getattr(exc, "failures", None) or {}
    for failure in failures.values():
        error = failure[0] if isinstance(failure, tuple) else failure
        text = str(error).strip()
        return type(error).__name__ + (f": {text.splitlines()[0]}" if text else "")
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
