"""``*.megatron.use_dist_checkpointing`` / ``dist_checkpointing_path``: initial weights from a
Megatron distributed checkpoint, checked before any process starts.

As in verl 0.9.1, the path holds one distributed checkpoint loaded instead of the HF weights;
the model is still built from ``model.path``'s ``config.json`` and tokenizer, and vLLM still
starts from its safetensors. megarl reads the checkpoint's ``megarl_meta.json`` (written by
``megarl convert hf-to-megatron`` and by megarl's own checkpoints, at any TP×PP) and refuses, in
one line, a checkpoint of another architecture or shape than ``model.path``'s; one without that
file is checked only by the load itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.config.checkpoint_meta import read_checkpoint_meta
from megarl.config.model_dims import ModelDims, read_hf_config

SHAPE_FIELDS = (
    "architecture",
    "hidden_size",
    "ffn_hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "vocab_size",
    "qkv_bias",
    "qk_norm",
    "tie_word_embeddings",
    "num_experts",
)
"""What a checkpoint's tensors are determined by: a difference in any of them is a mismatch."""


def dist_checkpoint_sections(cfg: Any) -> list[tuple[str, Any, str | None]]:
    """``(megatron section key, section, model path)`` of actor, reference and critic."""
    arr = cfg.actor_rollout_ref
    return [
        ("actor_rollout_ref.actor.megatron", arr.actor.megatron, arr.model.path),
        ("actor_rollout_ref.ref.megatron", arr.ref.megatron, arr.model.path),
        ("critic.megatron", cfg.critic.megatron, cfg.critic.model.path or arr.model.path),
    ]


def check_dist_checkpoints(
    cfg: Any, *, error: Callable[[str], None], problem: Callable[[str], None]
) -> None:
    """Report each section whose dist checkpoint is missing or holds another model.

    ``error``: always an error; ``problem``: an error when paths are checked (``megarl train``),
    else a warning (a cluster config validated on a laptop).
    """
    for key, meg, model_path in dist_checkpoint_sections(cfg):
        if not meg.use_dist_checkpointing:
            continue
        if not meg.dist_checkpointing_path:
            error(f"{key}.use_dist_checkpointing=true needs {key}.dist_checkpointing_path")
            continue
        path = Path(meg.dist_checkpointing_path).expanduser()
        if not (path / "metadata.json").is_file():
            problem(
                f"{key}.dist_checkpointing_path={str(path)!r} is not a Megatron distributed "
                "checkpoint (no metadata.json); write one with `megarl convert hf-to-megatron`"
            )
            continue
        try:
            hf_config = read_hf_config(Path(model_path).expanduser()) if model_path else None
        except (OSError, ValueError):
            hf_config = None  # reported by the model checks
        mismatch = checkpoint_mismatch(path, hf_config)
        if mismatch:
            error(f"{key}.dist_checkpointing_path={str(path)!r} {mismatch}")


def checkpoint_mismatch(ckpt: str | Path, hf_config: dict | None) -> str | None:
    """How the model saved in ``ckpt`` (its ``megarl_meta.json``) differs from the model of
    ``hf_config`` (a config.json); None: it fits, or either is unknown (the load then decides:
    Megatron refuses other tensor shapes but lets the vocabulary differ, for padding)."""
    saved = read_checkpoint_meta(ckpt).get("hf_config")
    if not saved or not hf_config:
        return None
    try:
        want = ModelDims.from_hf_config(hf_config)
        have = ModelDims.from_hf_config(saved)
    except (ValueError, KeyError):
        return None
    diffs = [
        f"{name} {getattr(have, name)} (model.path: {getattr(want, name)})"
        for name in SHAPE_FIELDS
        if getattr(have, name) != getattr(want, name)
    ]
    return f"holds another model: {', '.join(diffs)}" if diffs else None
