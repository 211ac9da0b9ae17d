"""megarl's configuration: a typed dataclass tree with verl's key names, loaded from YAML.

Entry points: ``load_config(paths, overrides)`` → ``MegarlConfig``; ``validate(cfg, world_size)``
→ warnings (raises ``ConfigError`` listing every problem); ``to_yaml(cfg)``;
``BatchPlan.from_config(cfg, world_size)`` → the step's batch sizes in verl's units;
``cfg.<role>.megatron.parallel_layout()`` → ``megarl.parallel.layout.ParallelLayout``;
``ModelDims.from_hf_config(read_hf_config(path))`` → the model's shape.

YAML files may inherit: ``_base_: base.yaml`` (or a list, merged in order, paths relative to the
file), then the file's own keys are merged on top. Command-line overrides are dotted:
``a.b.c=1``, ``a.list=[x,y]``, ``a.flag=true``, ``a.key=null``; ``+a.b.new=…`` adds a key to a
free-form section (``dict`` fields such as ``engine_kwargs``); ``~a.b`` removes a key (a schema
field then gets its default). String values may refer to other keys: ``${trainer.project_name}``,
or to the environment: ``${oc.env:VAR}`` / ``${oc.env:VAR,default}``.

Keys megarl adds to verl's vocabulary:

- ``trainer.seed``, ``trainer.dtype`` (bf16|fp32), ``trainer.device`` (cuda|cpu, verl's),
  ``trainer.tracking_uri`` (MLflow)
- ``actor_rollout_ref.actor.megatron.{transformer_impl, recompute_granularity, recompute_method,
  recompute_num_layers, recompute_modules}`` (same under ``critic.megatron`` and
  ``actor_rollout_ref.ref.megatron``)
- ``actor_rollout_ref.rollout.{allow_non_unit_top_p_top_k,
  max_model_len, enforce_eager, kv_cache_memory_bytes}``, validation sampling in
  ``actor_rollout_ref.rollout.val_kwargs.{temperature, top_p, top_k, n, do_sample}``
- ``actor_rollout_ref.model.architecture.{architecture, num_attention_heads,
  num_key_value_heads, num_hidden_layers, hidden_size, intermediate_size, head_dim, vocab_size,
  max_position_embeddings, tie_word_embeddings, num_experts}`` (and ``critic.model.architecture``):
  the model's shape (HF names) for validation without its files.

Keys that default to unset (None) and then take another key's value are listed in
``keys.FOLLOWS`` (e.g. critic and ref parallel sizes follow the actor's); ``resolve_config``
fills them, and the loader calls it: ``resolve_config(MegarlConfig())`` is the default config.
"""

from megarl.config.batch import BatchPlan, PassBatches, critic_enabled, ref_used, world_size
from megarl.config.choices import (
    ADV_ESTIMATORS,
    GROUP_ESTIMATORS,
    KL_TYPES,
    LOSS_AGG_MODES,
    POLICY_LOSS_MODES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_LOG_PROB_MODES,
)
from megarl.config.errors import ConfigError
from megarl.config.loader import (
    from_dict,
    get_key,
    load_config,
    resolve_config,
    to_dict,
    to_yaml,
)
from megarl.config.model_dims import ModelDims, known_dims, read_hf_config
from megarl.config.schema import (
    ActorConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    ArchitectureConfig,
    CriticConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    KLCtrlConfig,
    MegarlConfig,
    MegatronConfig,
    ModelConfig,
    OptimConfig,
    PolicyLossConfig,
    RefConfig,
    RewardModelConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    SamplingConfig,
    TrainerConfig,
)
from megarl.config.validate import validate

__all__ = [
    "ADV_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_MODES",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_LOG_PROB_MODES",
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "ArchitectureConfig",
    "BatchPlan",
    "ConfigError",
    "CriticConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "KLCtrlConfig",
    "MegarlConfig",
    "MegatronConfig",
    "ModelConfig",
    "ModelDims",
    "OptimConfig",
    "PassBatches",
    "PolicyLossConfig",
    "RefConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SamplingConfig",
    "TrainerConfig",
    "critic_enabled",
    "from_dict",
    "get_key",
    "known_dims",
    "load_config",
    "read_hf_config",
    "ref_used",
    "resolve_config",
    "to_dict",
    "to_yaml",
    "validate",
    "world_size",
]
