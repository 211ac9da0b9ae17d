"""Where every model's state and the rollout engine live in each phase of a step, declared once.

The trainer moves state by this schedule (:mod:`megarl.trainer.residency`) and the memory
planner sums the bytes of the same schedule, so ``megarl plan`` describes the states the trainer
actually reaches. Pure: no torch, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.batch_plan import critic_enabled, ref_used, rollout_ranks, teacher_used
from megarl.config.lora_checks import lora_enabled
from megarl.config.schema import MegarlConfig

PHASES = (
    "setup",
    "generate",
    "reward",
    "old_log_prob",
    "ref",
    "teacher",
    "values",
    "update_critic",
    "update_actor",
    "sync",
    "checkpoint",
)
"""Every phase, in the order a step runs them (``setup`` once, before the first step;
``checkpoint`` after a step that saves, and when a run resumes). ``setup``: every model built,
the engine asleep at level 2 from its start (the first wake syncs the weights in); ``generate``:
the engine awake (validation and ReMax's greedy baseline too); ``reward``: the engine asleep
until ``sync`` (a reward model keeps its own offload switch, outside this schedule); the passes:
the model computing holds its parameters, the model training everything; ``sync``: the engine's
weights awake, not its KV cache; ``checkpoint``: the saved models' parameters and optimizer
state on the device, the engine as in ``sync``."""

_COMPUTES = {
    "old_log_prob": "actor",
    "ref": "ref",
    "teacher": "teacher",
    "values": "critic",
    "update_critic": "critic",
    "update_actor": "actor",
    "sync": "actor",  # the sync reads the actor's parameters
}
_TRAINS = {"update_critic": "critic", "update_actor": "actor"}
_SAVED = ("actor", "critic")


@dataclass(frozen=True)
class ModelResidency:
    """What of one model is on the device (True) or in host memory (False)."""

    params: bool
    grads: bool
    """Gradient buffers (the reference has none: always False)."""
    optimizer: bool
    """Main parameters and optimizer moments (the reference has none: always False)."""


@dataclass(frozen=True)
class EngineResidency:
    """What of the rollout engine (vLLM) is on the device."""

    weights: bool
    kv_cache: bool


@dataclass(frozen=True)
class Residency:
    """One phase: every model present in the run, and the engine."""

    models: dict[str, ModelResidency]
    engine: EngineResidency | None
    """None: no engine on these devices (the actor generates, or vLLM runs on ranks of its
    own)."""


@dataclass(frozen=True)
class Offloads:
    """One model's ``*.megatron.{param,grad,optimizer}_offload``."""

    params: bool
    grads: bool
    optimizer: bool


def model_offloads(cfg: MegarlConfig) -> dict[str, Offloads]:
    """The offload switches of every model the run builds (actor; critic, ref when used and not
    the actor with its LoRA adapters off)."""
    arr = cfg.actor_rollout_ref
    out = {"actor": _offloads(arr.actor.megatron)}
    if critic_enabled(cfg):
        out["critic"] = _offloads(cfg.critic.megatron)
    if ref_used(cfg) and not lora_enabled(cfg):
        out["ref"] = Offloads(bool(arr.ref.megatron.param_offload), False, False)
    if teacher_used(cfg):  # frozen, offloaded as the reference is (ref.megatron.param_offload)
        out["teacher"] = Offloads(bool(arr.ref.megatron.param_offload), False, False)
    return out


def _offloads(meg) -> Offloads:
    return Offloads(bool(meg.param_offload), bool(meg.grad_offload), bool(meg.optimizer_offload))


def engine_is_vllm(cfg: MegarlConfig) -> bool:
    return cfg.actor_rollout_ref.rollout.name == "vllm"


def engine_on_training_ranks(cfg: MegarlConfig) -> bool:
    """vLLM shares the training ranks' devices (not on ranks of its own)."""
    return engine_is_vllm(cfg) and not rollout_ranks(cfg)


def phases_of(cfg: MegarlConfig) -> tuple[str, ...]:
    """The phases a run of ``cfg`` goes through (no ``ref`` without a reference, no ``values``
    or ``update_critic`` without a critic)."""
    roles = model_offloads(cfg)
    skip = set()
    if not ref_used(cfg):
        skip.add("ref")
    if "teacher" not in roles:
        skip.add("teacher")
    if "critic" not in roles:
        skip |= {"values", "update_critic"}
    return tuple(p for p in PHASES if p not in skip)


def residency(cfg: MegarlConfig, phase: str) -> Residency:
    """What is on the device in ``phase`` (one of :data:`PHASES`) for a run of ``cfg``: a
    model's parameters, gradient buffers and optimizer state leave the device outside the phases
    that need them exactly when its ``*_offload`` switches say so; with
    ``rollout.free_cache_engine`` vLLM's KV cache sleeps outside ``generate``, its weights
    outside ``generate``, ``sync`` and ``checkpoint`` (level: :func:`sleep_level`)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
    computes, trains = _COMPUTES.get(phase), _TRAINS.get(phase)
    if phase == "generate" and not engine_is_vllm(cfg):
        computes = "actor"  # the actor samples itself
    if phase == "ref" and lora_enabled(cfg):
        computes = "actor"  # the reference is the actor with its adapters off
    models = {}
    for role, off in model_offloads(cfg).items():
        trainable = role not in ("ref", "teacher")
        saved = phase == "checkpoint" and role in _SAVED
        models[role] = ModelResidency(
            params=saved or role == computes or not off.params,
            grads=trainable and (role == trains or not off.grads),
            optimizer=trainable and (saved or role == trains or not off.optimizer),
        )
    engine = None
    if engine_on_training_ranks(cfg):
        awake = not cfg.actor_rollout_ref.rollout.free_cache_engine
        engine = EngineResidency(
            weights=awake or phase in ("generate", "sync", "checkpoint"),
            kv_cache=awake or phase == "generate",
        )
    return Residency(models, engine)


def schedule(cfg: MegarlConfig) -> dict[str, Residency]:
    """:func:`residency` of every phase of :func:`phases_of`, in order."""
    return {phase: residency(cfg, phase) for phase in phases_of(cfg)}


def sleep_level(cfg: MegarlConfig, next_step: int | None) -> int:
    """vLLM's sleep level until its next wake: 2 when that wake updates the weights (``next_step``
    None: the first wake after start, which always syncs), 1 when step ``next_step`` keeps them
    (``trainer.skip_weight_sync_steps``) or the base it holds (LoRA with ``merge=false``: only
    the adapters follow)."""
    lora = cfg.actor_rollout_ref.model.lora
    if next_step is not None and lora.rank > 0 and not lora.merge:
        return 1
    if next_step is None or next_step not in cfg.trainer.skip_weight_sync_steps:
        return 2
    return 1
