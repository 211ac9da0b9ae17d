"""HF side files of a Megatron checkpoint, and the export of model chunks as an HF directory.

Shared by ``megarl convert`` and the trainer: every actor checkpoint keeps the HF side files,
so ``megarl convert megatron-to-hf --ckpt <run>/global_step_<N>/actor`` works, and the final save
exports ``actor/huggingface``. Light to import (torch only inside :func:`export_hf`):
``megarl convert`` imports it at start.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megarl.checkpoint.layout import META_FORMAT


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the non-weight top-level files of an HF directory (config, tokenizer, generation
    config...) into ``dst``; returns their names."""
    from megarl.models.weights import is_weight_file  # Megatron: only when used

    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(Path(src).iterdir()):
        if not f.is_file() or is_weight_file(f.name):
            continue
        shutil.copy2(f, dst / f.name)
        copied.append(f.name)
    return copied


def checkpoint_meta(
    hf_config: dict, *, source: str, dtype: str, layout: dict, **extra: object
) -> dict:
    """``megarl_meta.json`` of a model checkpoint (what ``megarl convert`` reads back)."""
    return {
        "format": META_FORMAT,
        "hf_config": hf_config,
        "source": source,
        "dtype": dtype,
        "saved_layout": layout,
        **extra,
    }


def export_hf(
    chunks: Sequence[Any],
    out: str | Path,
    dims,
    *,
    hf_config: dict,
    dtype_name: str,
    side_dir: Path | None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write ``chunks`` (any TP×PP×DP layout) as an HF directory in ``dtype_name``, with the
    config (dtype updated) and the tokenizer/generation files of ``side_dir`` (collective)."""
    import torch

    from megarl.models.weights import export_hf_weights

    out_cfg = {**hf_config, "dtype": dtype_name}
    if "torch_dtype" in out_cfg:
        out_cfg["torch_dtype"] = dtype_name
    return export_hf_weights(
        chunks,
        out,
        dims,
        source_dir=side_dir,
        hf_config=out_cfg,
        dtype=getattr(torch, dtype_name),
        progress=progress,
    )
