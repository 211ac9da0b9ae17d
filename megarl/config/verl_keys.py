"""verl keys megarl does not support, with the reason: refused as "unsupported: <key>", never as
"unknown".

The table covers every key of verl 0.9.1's composed PPO Megatron trainer config that megarl's
schema lacks (the vendored ``data/verl_ppo_megatron_trainer.yaml`` holds them all). Such a key is
accepted at verl's default (:mod:`megarl.config.verl_defaults`: the feature is off there) and
refused at any other value with the reason given here. A key matches when a pattern matches it or
one of its parent sections; patterns are dotted, ``*`` matches within one segment. Keys the schema
has are never looked up here.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
"""Sections that carry a Megatron engine (``megatron``, ``optim``, ``profiler``...)."""
_MODELS = ("actor_rollout_ref.model", "critic.model")
_NO_RAY = "megarl runs SPMD under torchrun (no Ray)"
_DATA = "data option not supported yet"
_REWARD = "reward option not supported yet"
_RM_ON_MEGATRON = "the reward model runs on Megatron, colocated at the actor's TP×PP layout"
_MULTIMODAL = "the vision tower trains or stays fixed with the actor's (actor.freeze_vision_tower)"
_LORA = "no LoRA on the critic: it trains full weights (LoRA: actor_rollout_ref.model.lora.*)"
_FSDP_LORA = "verl's FSDP LoRA key; megarl takes the Megatron ones: actor_rollout_ref.model.lora.*"
_PROFILE = "no profiler integration"
_OFFLOAD_KEYS = "set param_offload / grad_offload / optimizer_offload"


def _each(prefixes: tuple[str, ...], tail: str, reason: str) -> list[tuple[str, str]]:
    return [(f"{p}.{tail}", reason) for p in prefixes]


UNSUPPORTED: tuple[tuple[str, str], ...] = (
    ("*._target_", "Hydra instantiation target; megarl's config is typed, drop it"),
    ("*.*._target_", "Hydra instantiation target; megarl's config is typed, drop it"),
    ("*.*.*._target_", "Hydra instantiation target; megarl's config is typed, drop it"),
    ("*.*.*.*._target_", "Hydra instantiation target; megarl's config is typed, drop it"),
    # -- whole sections ------------------------------------------------------------------------
    ("ray_kwargs", _NO_RAY),
    ("transfer_queue", "no transfer queue: batches travel over torch.distributed"),
    ("global_profiler", _PROFILE),
    ("skip", "no rollout skipping / replay"),
    ("reward.reward_model.rollout", _RM_ON_MEGATRON),
    ("algorithm.use_pf_ppo", "no preference-feedback PPO reweighting"),
    ("algorithm.pf_ppo", "no preference-feedback PPO reweighting"),
    # -- engine sections (actor, ref, critic) -----------------------------------------------------
    *_each(ROLES, "profiler", _PROFILE),
    *_each(ROLES, "checkpoint.mbridge_config", "megarl maps HF weights itself"),
    *_each(ROLES, "shuffle", "responses keep their order (see trainer.balance_batch)"),
    *_each(ROLES, "loss_scale_factor", "set on the actor (loss_scale_factor) only"),
    *_each(ROLES, "qat", "no quantization-aware training"),
    *_each(ROLES[1:], "freeze_vision_tower", _MULTIMODAL),
    *_each(ROLES, "use_prefix_grouper", "no prefix-shared forward passes"),
    *_each(ROLES, "calculate_sum_pi_squared", "no optimal-token-baseline statistics"),
    *_each(ROLES, "tau_pos", "no SAPO soft gate"),
    *_each(ROLES, "tau_neg", "no SAPO soft gate"),
    *_each(ROLES, "calculate_entropy", "entropy is computed when entropy_coeff > 0"),
    *_each(ROLES, "use_dynamic_bsz", "the reference uses log_prob_use_dynamic_bsz"),
    *_each(ROLES, "ppo_max_token_len_per_gpu", "the reference uses log_prob_max_token_len_per_gpu"),
    *_each(ROLES, "optim.muon_*", "no Muon optimizer (adam or sgd)"),
    *_each(ROLES, "megatron.router_replay.*_file", "routing is replayed in memory within each step"),
    *_each(ROLES, "megatron.dynamic_context_parallel", "context parallelism is static"),
    *_each(ROLES, "megatron.max_seqlen_per_dp_cp_rank", "context parallelism is static"),
    *_each(ROLES, "megatron.override_ddp_config", "Megatron's DDP config is megarl's"),
    *_each(ROLES, "megatron.pad_*", "packed sequences are padded to what Megatron needs (TP with SP, 2·CP)"),
    *_each(ROLES, "megatron.qat", "no quantization-aware training"),
    ("actor_rollout_ref.ref.megatron.param_offload", _OFFLOAD_KEYS),
    # -- model sections ----------------------------------------------------------------------------
    ("critic.model.lora*", _LORA),
    *_each(_MODELS, "lora_*", _FSDP_LORA),
    *_each(_MODELS, "target_modules", _FSDP_LORA),
    *_each(_MODELS, "exclude_modules", _FSDP_LORA),
    *_each(_MODELS, "tiled_mlp", "no tiled MLP"),
    *_each(_MODELS, "mtp", "no multi-token prediction"),
    # -- rollout -------------------------------------------------------------------------------------
    ("actor_rollout_ref.rollout.cudagraph_capture_sizes", "use engine_kwargs"),
    ("actor_rollout_ref.rollout.full_determinism", "use engine_kwargs"),
    ("actor_rollout_ref.rollout.scheduling_policy", "use engine_kwargs"),
    ("actor_rollout_ref.rollout.qat", "no quantization-aware training"),
    ("actor_rollout_ref.rollout.mtp", "no multi-token prediction"),
    ("actor_rollout_ref.rollout.moe_load_balance_metrics_interval", "no rollout-side MoE load metrics"),
    ("actor_rollout_ref.rollout.router_config_path", "the router follows the HF config"),
    ("actor_rollout_ref.rollout.agent", "one agent loop: the tool agent loop of rollout.multi_turn"),
    ("actor_rollout_ref.rollout.trace", "no rollout tracing"),
    ("actor_rollout_ref.rollout.profiler", _PROFILE),
    ("actor_rollout_ref.rollout.prometheus", "no Prometheus metrics"),
    ("actor_rollout_ref.rollout.disaggregation", "vLLM on ranks of its own is actor_rollout_ref.rollout.nnodes"),
    ("actor_rollout_ref.rollout.val_kwargs.*", "not a validation-sampling option megarl has"),
    # -- policy loss (keys of loss modes megarl does not offer yet) ----------------------------------
    ("actor_rollout_ref.actor.policy_loss.*", "option of a policy loss megarl does not offer yet"),
    # -- data, rewards, trainer (other sections' owners may add some of these) -------------------------
    ("data.video_key", "videos are not built (images only: data.image_key)"),
    ("data.*", _DATA),
    ("reward_model.rollout", _RM_ON_MEGATRON),
    ("reward_model.enable_resource_pool", _RM_ON_MEGATRON),
    ("reward_model.n_gpus_per_node", _RM_ON_MEGATRON),
    ("reward_model.nnodes", _RM_ON_MEGATRON),
    ("reward_model.*", _REWARD),
    ("custom_reward_function.*", _REWARD),
    ("trainer.esi_redundant_time", "no elastic-server-instance expiry handling"),
    ("trainer.checkpoint_callback_class", "no checkpoint callbacks"),
    ("trainer.ray_wait_register_center_timeout", _NO_RAY),
    ("trainer.v1", "one trainer: megarl's"),
)  # fmt: skip
"""(pattern, reason) per verl key (or section) megarl does not support."""


def unsupported_reason(key: str) -> str | None:
    """Why the verl key ``key`` is not supported, or None when it is not in the table."""
    parts = key.split(".")
    for pattern, reason in UNSUPPORTED:
        segs = pattern.split(".")
        if len(segs) <= len(parts) and all(
            fnmatchcase(p, s) for p, s in zip(parts, segs, strict=False)
        ):
            return reason
    return None
