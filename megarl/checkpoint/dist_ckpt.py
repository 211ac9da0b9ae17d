"""Megatron distributed checkpoints of model chunks (the on-disk format used on GPU too).

``dist_checkpointing`` stores each tensor under its global key with its global shape, so a
checkpoint saved at one TP×PP(×VPP) loads at any other. Chunks are stored as ``model{i}`` (their
ShardedTensors carry global layer indices, so the nesting does not tie the checkpoint to a VPP
size).

CPU note (DESIGN.md): the default ``torch_dist`` save strategy starts a ``spawn``-context
``multiprocessing.Manager`` whose child re-imports the launching script; every entry point must
keep its work under ``if __name__ == "__main__":`` (and ``psutil`` must be installed) or the save
hangs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megarl.checkpoint.layout import META_FILE
from megarl.models.gpt import unwrap

__all__ = ["META_FILE", "load_model_checkpoint", "read_checkpoint_meta", "save_model_checkpoint"]


def _sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict:
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


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
    dist_checkpointing.save(_sharded_state_dict(chunks), str(path))
    # Written after the shards: Megatron treats extra files in the directory before a save as
    # the remains of an incomplete checkpoint.
    if dist.get_rank() == 0 and meta is not None:
        (path / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    dist.barrier()
    return path


def read_checkpoint_meta(ckpt_dir: str | Path) -> dict:
    """The ``meta`` saved with the checkpoint (empty dict when there is none)."""
    f = Path(ckpt_dir) / META_FILE
    return json.loads(f.read_text()) if f.exists() else {}


def load_model_checkpoint(chunks: Sequence[torch.nn.Module], ckpt_dir: str | Path) -> None:
    """Load ``ckpt_dir`` (saved at any parallel layout) into this rank's ``chunks``."""
    path = Path(ckpt_dir)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"not a Megatron distributed checkpoint: {path}")
    state = dist_checkpointing.load(_sharded_state_dict(chunks), str(path))
    for i, chunk in enumerate(chunks):
        missing, unexpected = unwrap(chunk).load_state_dict(state[f"model{i}"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(
                f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
