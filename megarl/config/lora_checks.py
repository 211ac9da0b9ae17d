"""Checks of ``actor_rollout_ref.model.lora.*`` (LoRA adapters on the actor,
:mod:`megarl.models.lora`), each problem one line naming its key."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from megarl.config.batch_plan import stages_weight_updates
from megarl.config.layout_checks import fmt_value

__all__ = ["LORA_TARGETS", "check_lora", "check_lora_moe"]

Error = Callable[[str], None]

L = "actor_rollout_ref.model.lora"
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron linears megarl adapts (``megarl.models.lora.LORA_TARGETS``)."""
INIT_METHODS = ("xavier", "kaiming", "normal", "zero")
PEFT_CONFIG = "adapter_config.json"


def check_lora(cfg, error: Error) -> None:
    """Report what megarl cannot do with the LoRA settings through ``error``."""
    lora = cfg.actor_rollout_ref.model.lora
    if isinstance(lora.rank, bool) or lora.rank < 0:
        error(f"{L}.rank={fmt_value(lora.rank)} must be >= 0 (0: no adapters)")
        return
    if lora.rank == 0:
        return
    if lora.type != "lora":
        error(
            f"{L}.type={fmt_value(lora.type)} is not built; use lora (one adapter per fused linear)"
        )
    bad = [t for t in lora.target_modules if t not in LORA_TARGETS]
    if bad:
        error(f"{L}.target_modules {bad} are not linears megarl adapts: {list(LORA_TARGETS)}")
    if lora.exclude_modules and lora.target_modules:
        error(f"{L}.exclude_modules needs target_modules=[] (as verl: every linear but those)")
    for key in ("lora_A_init_method", "lora_B_init_method"):
        if getattr(lora, key) not in INIT_METHODS:
            error(f"{L}.{key}={fmt_value(getattr(lora, key))}: use one of {list(INIT_METHODS)}")
    if lora.dropout_position not in ("pre", "post"):
        error(f"{L}.dropout_position={fmt_value(lora.dropout_position)} must be pre or post")
    if not 0.0 <= lora.dropout < 1.0:
        error(f"{L}.dropout={fmt_value(lora.dropout)} must be in [0, 1)")
    if lora.adapter_path and not (Path(lora.adapter_path).expanduser() / PEFT_CONFIG).is_file():
        error(
            f"{L}.adapter_path={lora.adapter_path} holds no {PEFT_CONFIG} (a PEFT adapter folder)"
        )
    if lora.a2a_experimental:
        error(f"{L}.a2a_experimental=true is not built; use false")
    if lora.dtype is not None:
        error(f"{L}.dtype is not built: adapters take the actor's dtype; leave it null")
    if not lora.merge and stages_weight_updates(cfg):
        error(
            f"{L}.merge=false with vLLM on ranks of its own needs "
            "async_training.staleness_threshold <= 1 (staged weight updates carry no adapters); "
            f"set {L}.merge=true"
        )
    if cfg.actor_rollout_ref.actor.megatron.use_dist_checkpointing:
        # the adapters' checkpoints, PEFT exports and `megarl convert` name model.path as the
        # base they adapt; a base read from a Megatron checkpoint would be replaced by it there
        error(
            f"{L}.rank > 0 with actor_rollout_ref.actor.megatron.use_dist_checkpointing=true is not "
            "built: LoRA's base is actor_rollout_ref.model.path (convert the checkpoint to HF)"
        )


def check_lora_moe(cfg, shape, error: Error) -> None:
    """LoRA on a Mixture-of-Experts actor (``shape``: the model's, or None when unknown): expert
    adapters train and sync merged; adapter-only syncs (``merge=false``) would need vLLM's LoRA
    on fused MoE experts, which its CPU build lacks and megarl does not build."""
    lora = cfg.actor_rollout_ref.model.lora
    if lora.rank <= 0 or not shape or not shape.get("num_experts") or lora.merge:
        return
    error(
        f"{L}.merge=false on a Mixture-of-Experts model ({shape.source}) is not built (vLLM 0.32 "
        f"puts LoRA on fused MoE experts only with its Triton GPU kernels): set {L}.merge=true"
    )


def lora_enabled(cfg) -> bool:
    """The actor trains LoRA adapters (``actor_rollout_ref.model.lora.rank`` > 0): the reference
    is then the actor with its adapters off, not a model of its own."""
    return cfg.actor_rollout_ref.model.lora.rank > 0
