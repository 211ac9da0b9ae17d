"""Pre-flight checks of a vision-language run (issue 58: Qwen2.5-VL, Qwen2-VL), each problem one
line naming its key: what ``megarl train`` cannot do with a VL actor yet, and
``actor.freeze_vision_tower`` on a text model.

A checkpoint is vision-language when its ``config.json``'s ``model_type`` is one of
:data:`VL_MODEL_TYPES` (:func:`vision_language_model_type`; the trainer then builds
:func:`megarl.models.vision_language.build_vision_language_model`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from megarl.config.async_schedule import partial_rollouts, rollout_ranks
from megarl.config.batch_plan import critic_enabled

__all__ = ["VL_MODEL_TYPES", "check_vision_language", "vision_language_model_type"]

Error = Callable[[str], None]

VL_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")
"""``model_type`` of the vision-language families megarl trains."""

ARR = "actor_rollout_ref"
MEG = f"{ARR}.actor.megatron"


def vision_language_model_type(path: str | Path | None) -> str | None:
    """The ``model_type`` of the local checkpoint at ``path`` when it is a VL family, else None
    (a text model, or no readable ``config.json``: other checks report that)."""
    if not path:
        return None
    config = Path(path).expanduser() / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    return model_type if model_type in VL_MODEL_TYPES else None


def check_vision_language(cfg, error: Error) -> None:
    """Report through ``error`` what a VL actor cannot do yet (one line each), or
    ``freeze_vision_tower=true`` on a text model."""
    arr = cfg.actor_rollout_ref
    model_type = vision_language_model_type(arr.model.path)
    if model_type is None:
        if arr.actor.freeze_vision_tower:
            error(f"{ARR}.actor.freeze_vision_tower=true needs a vision-language checkpoint "
                  f"({', '.join(VL_MODEL_TYPES)}); {ARR}.model.path is a text model")  # fmt: skip
        return
    vl = f"a vision-language actor ({model_type})"
    # a model's passes pack when its megatron.use_remove_padding says so, else when the model
    # section's does (megarl.trainer.setup.packs)
    packed = [f"{role}.megatron.use_remove_padding" for role in (f"{ARR}.actor", f"{ARR}.ref")
              if getattr(arr, role.rsplit(".", 1)[1]).megatron.use_remove_padding]  # fmt: skip
    engine_keys = (arr.actor.megatron.use_remove_padding, arr.ref.megatron.use_remove_padding)
    if arr.model.use_remove_padding and None in engine_keys:
        packed.insert(0, f"{ARR}.model.use_remove_padding")
    for key in packed:
        error(
            f"{key}=true: packed rows (THD) of {vl} are not built; set it to false "
            "(right-padded rows)"
        )
    meg = arr.actor.megatron
    if meg.context_parallel_size > 1:
        error(f"{MEG}.context_parallel_size={meg.context_parallel_size}: context parallelism "
              f"of {vl} is not built; use 1")  # fmt: skip
    if meg.sequence_parallel and meg.tensor_model_parallel_size > 1:
        error(f"{MEG}.sequence_parallel=true: sequence parallelism of {vl} is not built; "
              "set it to false")  # fmt: skip
    vpp = meg.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1:
        error(f"{MEG}.virtual_pipeline_model_parallel_size={vpp}: VPP of {vl} is not built; "
              "leave it unset")  # fmt: skip
    if meg.expert_model_parallel_size > 1:
        error(f"{MEG}.expert_model_parallel_size={meg.expert_model_parallel_size}: {vl} has "
              "no experts; use 1")  # fmt: skip
    if meg.use_dist_checkpointing:
        error(f"{MEG}.use_dist_checkpointing=true: {vl} loads from its HF checkpoint only")
    if arr.model.lora.rank > 0:
        error(f"{ARR}.model.lora.rank={arr.model.lora.rank}: LoRA on {vl} is not built; use 0")
    if meg.router_replay.mode != "disabled":
        error(f"{MEG}.router_replay.mode={meg.router_replay.mode}: {vl} has no experts to "
              "replay; use disabled")  # fmt: skip
    if arr.rollout.name != "vllm":
        error(f"{ARR}.rollout.name={arr.rollout.name}: {vl}'s image prompts are generated "
              "by vLLM only; use vllm")  # fmt: skip
    if rollout_ranks(cfg):
        error(f"{ARR}.rollout.nnodes={arr.rollout.nnodes}: vLLM on ranks of its own for {vl} is "
              "not built; use 0 (colocated)")  # fmt: skip
    if partial_rollouts(cfg):
        error(f"async_training.partial_rollout=true: partial rollouts of {vl} are not built; "
              "use false")  # fmt: skip
    if arr.rollout.multi_turn.enable:
        error(f"{ARR}.rollout.multi_turn.enable=true: multi-turn rollouts of {vl} are not "
              "built; use false")  # fmt: skip
    if critic_enabled(cfg):
        error(f"critic.enable=true (or algorithm.adv_estimator=gae): a critic for {vl} is not "
              "built; use a critic-free estimator (grpo, rloo, ...)")  # fmt: skip
    if cfg.distillation.enabled:
        error(f"distillation.enabled=true: distillation of {vl} is not built; use false")
    if cfg.reward_model.enable:
        error(f"reward_model.enable=true: a learned reward model with {vl}'s image prompts is "
              "not built; use rule rewards")  # fmt: skip
