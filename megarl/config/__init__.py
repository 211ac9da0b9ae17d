"""megarl's configuration: a typed dataclass tree with verl's key names, loaded from YAML and
validated before anything distributed starts.

Entry points: ``load_config(paths, overrides)`` → ``MegarlConfig``; ``validate(cfg, world_size)``
→ warnings (raises ``ConfigError`` listing every problem); ``to_yaml(cfg)``;
``BatchPlan.from_config(cfg, world_size)`` → the step's batch sizes in verl's units;
``ModelDims.from_hf_config(read_hf_config(path))`` → the model's shape. Whether a config fits in
GPU memory is the planner's question (:mod:`megarl.planner`).

A YAML file may inherit (``_base_: base.yaml``, or a list merged in order). Overrides are dotted:
``a.b.c=1``, ``a.list=[x,y]``, ``a.key=null``; ``+a.b.new=…`` adds a key to a free-form section,
``~a.b`` removes one; values may refer to ``${other.key}`` or ``${oc.env:VAR,default}``. Fields
megarl adds to verl's vocabulary say "(megarl)" in their docstring (``megarl config keys``).
"""

from megarl.config.batch_plan import BatchPlan, PassBatches, critic_enabled, ref_used, world_size
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
    RolloutCorrectionConfig,
    TrainerConfig,
)
from megarl.config.schema_model import ArchitectureConfig
from megarl.config.schema_rollout import RolloutConfig, SamplingConfig
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
