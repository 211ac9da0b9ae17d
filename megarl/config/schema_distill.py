"""``distillation.*``: verl 0.9.1's on-policy distillation section, its keys and meaning.

The defaults are those of verl's composed YAML (``trainer/config/distillation/distillation.yaml``),
which differ from its dataclass defaults: ``loss_mode=k3``, ``topk=32``, ``use_task_rewards=true``,
``use_policy_gradient=false``, no clamps. The checks are :mod:`megarl.config.distillation_checks`;
the loss math is :mod:`megarl.algo.distillation`. megarl runs one teacher, served by vLLM on a
pool of its own (verl's default) or as a frozen Megatron model on the training ranks
(``inference.name=megatron``), with every loss mode; several teachers are refused
(docs/distillation.md).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

DistillationLossMode = Literal[
    "forward_kl_topk", "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"
]
DISTILLATION_LOSS_MODES: tuple[str, ...] = get_args(DistillationLossMode)
"""verl 0.9.1's registered distillation losses: one over the teacher's top-k, the rest
single-sample reverse-KL estimators on the sampled token (``megarl.algo.kl``'s names)."""
TOPK_LOSS_MODES = ("forward_kl_topk",)
"""Loss modes that need the teacher's top-k ids and log-probs (and vLLM ``max_logprobs >= topk``)."""

TEACHER_INFERENCE: dict[str, Any] = {
    "name": "${oc.select:actor_rollout_ref.rollout.name}",
    "dtype": "${oc.select:actor_rollout_ref.rollout.dtype}",
    "gpu_memory_utilization": 0.5,
    "enforce_eager": True,
    "cudagraph_capture_sizes": None,
    "free_cache_engine": True,
    "data_parallel_size": 1,
    "expert_parallel_size": 1,
    "tensor_model_parallel_size": 2,
    "max_num_batched_tokens": 8192,
    "max_model_len": None,
    "max_num_seqs": 1024,
    "load_format": "auto",
    "engine_kwargs": {},
    "limit_images": None,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": True,
    "disable_log_stats": True,
    "skip_tokenizer_init": True,
    "prompt_length": "${oc.select:actor_rollout_ref.rollout.prompt_length}",
    "response_length": "${oc.select:actor_rollout_ref.rollout.response_length}",
    "temperature": "${oc.select:actor_rollout_ref.rollout.temperature}",
}
"""verl 0.9.1's ``teacher_models.teacher_model.inference`` defaults (a vLLM rollout config;
the ``${...}`` ones follow the student's rollout)."""

TEACHER_MODEL: dict[str, Any] = {
    "key": None,
    "model_path": None,
    "num_replicas": 0,
    "inference": TEACHER_INFERENCE,
}
"""verl 0.9.1's default single teacher ``teacher_models.teacher_model``."""


@dataclass
class DistillationLossConfig:
    """``distillation.distillation_loss.*``: the divergence to the teacher and how it trains."""

    loss_mode: DistillationLossMode = "k3"
    """forward_kl_topk (the teacher's top-k) or a reverse-KL estimator on the sampled token."""
    topk: int | None = 32
    """k of the teacher's top-k log-probs (forward_kl_topk); vLLM's max_logprobs must be >= k."""
    use_task_rewards: bool = True
    """Also train on the task reward's policy loss (the distillation loss then x coef)."""
    distillation_loss_coef: float = 1.0
    """Weight of the distillation loss when use_task_rewards is true (else 1)."""
    loss_max_clamp: float | None = None
    """Per-token distillation loss clamped to [-c, c]; null: no clamp."""
    log_prob_min_clamp: float | None = None
    """forward_kl_topk: teacher and student top-k log-probs clamped below at this; null: none."""
    use_policy_gradient: bool = False
    """Advantage = -loss through the clipped policy loss (k1); false: backpropagate the loss."""
    policy_loss_mode: Literal["vanilla"] = "vanilla"
    """Policy loss of the policy-gradient mode; verl 0.9.1 offers vanilla only."""
    clip_ratio: float = 0.2
    """PPO clip ratio of the policy-gradient mode."""
    clip_ratio_low: float = 0.2
    """Lower PPO clip ratio of the policy-gradient mode."""
    clip_ratio_high: float = 0.2
    """Upper PPO clip ratio of the policy-gradient mode."""


@dataclass
class DistillationConfig:
    """``distillation.*`` (verl 0.9): on-policy distillation from one or more teachers."""

    enabled: bool = False
    """Distil from the teacher on the student's own samples (docs/distillation.md)."""
    n_gpus_per_node: int = 8
    """GPUs per node of the teachers' own pool."""
    nnodes: int = 0
    """Nodes of the teachers' own pool (its size: nnodes x n_gpus_per_node)."""
    teacher_models: dict[str, Any] = field(
        default_factory=lambda: {"teacher_model": copy.deepcopy(TEACHER_MODEL)}
    )
    """Free-form: name -> {key, model_path, num_replicas, inference.*} over verl's default teacher."""
    teacher_key: str = "data_source"
    """Sample field routing each sample to the teacher whose key equals it (several teachers)."""
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    """The loss and its mode."""

    def __post_init__(self) -> None:
        # Each teacher given in part keeps the default teacher's other keys, and the section
        # keeps the default teacher, as Hydra merges overrides and files into verl's tree
        # (``teacher_model.model_path=...`` keeps its inference.*; ``+teacher_models.math.*``
        # adds a teacher beside ``teacher_model``, which verl then leaves out of several).
        if isinstance(self.teacher_models, dict):
            given = {"teacher_model": {}, **self.teacher_models}
            self.teacher_models = {
                name: _merged(TEACHER_MODEL, entry) if isinstance(entry, dict) else entry
                for name, entry in given.items()
            }


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over a copy of ``base``, sections merged key by key."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
