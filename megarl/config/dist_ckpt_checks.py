"""``*.megatron.use_dist_checkpointing`` / ``dist_checkpointing_path``: initial weights from a
Megatron distributed checkpoint, checked before any process starts.

As in verl 0.9.1 (``McoreEngineConfig``; the Megatron engine's ``load_mcore_dist_weights``),
the path is a directory holding one Megatron distributed checkpoint (``metadata.json`` and
its shards), loaded into the model instead of the HF weights; the model is still built from
``model.path``'s ``config.json``, whose tokenizer is still used; the critic keeps its own value
head (every other tensor comes from the checkpoint); the actor, the reference and the critic each
have their own switch (the reference does not follow the actor's). Where megarl differs:

- The checkpoint is the output of ``megarl convert hf-to-megatron`` (or an actor/critic
  checkpoint of a megarl run), saved at any TP×PP(×VPP) and loaded at the run's layout.
  Its ``megarl_meta.json`` names the model it holds: another architecture or shape than
  ``model.path``'s is refused here, in one line naming the path and the mismatch. A checkpoint
  without that file (written by other tools) is checked only by the load itself.
- vLLM still starts from ``model.path``'s safetensors (megarl's engine loads real weights before
  the first sync; verl's default ``rollout.load_format=dummy`` does not), so the safetensors
  must be there and are read once, by the rollout engine only.
- verl's switch also makes the run save its own checkpoints as Megatron shards; megarl's
  checkpoints always are, so the switch changes nothing else: the run's own checkpoints and
  their resume (which replaces these initial weights) are as without it.
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
