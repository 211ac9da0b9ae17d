"""``*.optim.*``: the optimizer and learning-rate schedule of one trained model (actor, critic).

What ``override_optimizer_config`` may hold is :mod:`megarl.config.optim_overrides`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class OptimConfig:
    """``*.optim.*``: Megatron distributed optimizer and learning-rate schedule."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer (Megatron's names; adam is AdamW with decoupled weight decay)."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of a decaying schedule."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam beta1, beta2."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0: off)."""
    lr_warmup_steps: int = -1
    """Linear warm-up over this many trainer steps; -1: lr_warmup_steps_ratio decides."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up as a fraction of the total trainer steps (when lr_warmup_steps is -1)."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of the warm-up."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up, over lr_decay_steps."""
    lr_decay_steps: int | None = None
    """Trainer steps until the decay reaches min_lr (held after); null: the run's total steps."""
    use_checkpoint_opt_param_scheduler: bool = False
    """Resume takes the schedule (lr, warm-up, decay, weight decay) from the checkpoint."""
    total_training_steps: int | None = None
    """No effect, any value: verl's trainer overwrites it with the run's total steps (megarl too)."""
    weight_decay_incr_style: Literal["constant"] = "constant"
    """Only constant: weight decay does not change over the run."""
    lr_wsd_decay_style: str = "exponential"
    """No effect, any value: used by verl's WSD schedule only, which megarl does not have."""
    lr_wsd_decay_steps: int | None = None
    """No effect, any value (WSD schedule only)."""
    use_precision_aware_optimizer: bool = False
    """No effect, either value: at the fp32 dtypes below it keeps fp32 main params and moments."""
    main_grads_dtype: str = "fp32"
    """Only fp32 (main gradients are fp32)."""
    exp_avg_dtype: str = "fp32"
    """Only fp32 (Adam's first moment is fp32)."""
    exp_avg_sq_dtype: str = "fp32"
    """Only fp32 (Adam's second moment is fp32)."""
    use_layer_wise_distributed_optimizer: bool = False
    """Only false: the distributed optimizer shards over data-parallel ranks."""
    override_optimizer_config: dict[str, Any] = field(default_factory=dict)
    """Free-form: Megatron OptimizerConfig fields, applied last (adam_beta1/2, adam_eps, ...)."""
