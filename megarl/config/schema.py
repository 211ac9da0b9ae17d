"""The typed configuration tree: one dataclass per YAML section, one docstring per field.

Key names and defaults follow verl's PPO trainer (``ppo_megatron_trainer.yaml``) so that its
users' scripts and overrides keep working; fields megarl adds say "(megarl)" in their docstring.
Fields typed ``dict[str, Any]`` are free-form sections: their keys are not checked, and a new key
is added on the command line with ``+section.key=value``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.choices import (
    AdvEstimator,
    KLType,
    LossAggMode,
    PolicyLossMode,
    RolloutIsLevel,
)
from megarl.config.keys import SHARED_MEGATRON_KEYS
from megarl.config.schema_data import (
    AsyncTrainingConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    FilterGroupsConfig,
    RewardModelConfig,
)
from megarl.config.schema_distill import DistillationConfig
from megarl.config.schema_model import ModelConfig
from megarl.config.schema_optim import OptimConfig
from megarl.config.schema_reward import (
    RewardConfig,
    RolloutResourcesConfig,
    SandboxFusionConfig,
)
from megarl.config.schema_rollout import RolloutConfig
from megarl.parallel.layout import PIPELINE_SPLIT_FIELDS, ParallelLayout

# ---------------------------------------------------------------------------------------------
# actor, reference, critic
# ---------------------------------------------------------------------------------------------


@dataclass
class CheckpointConfig:
    """``*.checkpoint.*``: what a trainer checkpoint of this model holds and what a resume loads."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """Saved parts: model, optimizer, extra (LR scheduler), hf_model (<role>/huggingface)."""
    load_contents: list[str] | None = None
    """Parts loaded on resume (model, optimizer, extra); null: save_contents."""
    async_save: bool = False
    """Only false: saves are synchronous (all ranks, then an atomic rename)."""
    strict: bool = True
    """Only true: a resumed checkpoint must hold every parameter of the model."""


@dataclass
class RouterReplayConfig:
    """``*.megatron.router_replay.*``: routing replay of a Mixture-of-Experts actor (verl's
    section; :mod:`megarl.models.routing`). ``disabled``: every forward routes afresh. ``R2``:
    the update's forwards route each token to the experts the old-log-prob forward chose.
    ``R3``: the old-log-prob, reference and update forwards route each token to the experts the
    rollout engine chose (captured inside vLLM's worker: :mod:`megarl.rollout.routing_capture`)."""

    mode: Literal["disabled", "R2", "R3"] = "disabled"
    """R2: the update replays the old-log-prob pass's routing; R3: every forward replays vLLM's."""


@dataclass
class DDPConfig:
    """``*.megatron.override_ddp_config.*``: Megatron ``DistributedDataParallelConfig`` fields
    (verl's section; megarl types the keys it supports and turns the overlaps on by default,
    as Megatron's own training recipes do)."""

    overlap_grad_reduce: bool = True
    """Launch each gradient bucket's reduce-scatter / all-reduce from the backward pass."""
    overlap_param_gather: bool = True
    """With the distributed optimizer: overlap the parameter all-gather with the next forward."""
    bucket_size: int | None = None
    """Parameters per gradient bucket with overlap_grad_reduce; null: max(40M, 1M x DP)."""


@dataclass
class MegatronConfig:
    """``*.megatron.*``: Megatron-Core parallel layout and memory settings of one model."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (must divide attention heads and KV heads)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel stages (must divide the layer count)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved schedule); null: not interleaved."""
    context_parallel_size: int = 1
    """Context-parallel size (sequence split across ranks)."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size (MoE models only; must divide the experts)."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallelism inside each expert (MoE only); null: the TP size, Megatron's default."""
    sequence_parallel: bool = True
    """Sequence parallelism in the TP region (no effect at TP=1)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks."""
    param_offload: bool = False
    """Move parameters to CPU while the model is idle."""
    grad_offload: bool = False
    """Move gradients to CPU while the model is idle."""
    optimizer_offload: bool = False
    """Move optimizer state to CPU while the model is idle."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """(megarl) Layer spec: auto = Transformer Engine on CUDA, local on CPU."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """(megarl) Activation recompute: null (off), selective (recompute_modules) or full layers."""
    recompute_method: Literal["uniform", "block"] | None = None
    """(megarl) For full recompute: how layers are grouped (Megatron's recompute_method)."""
    recompute_num_layers: int | None = None
    """(megarl) For full recompute: layers per group (uniform) or per stage (block)."""
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """(megarl) For selective recompute: submodules recomputed (Megatron's recompute_modules)."""
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    """Free-form: extra TransformerConfig fields, applied last."""
    bias_activation_fusion: bool = True
    """(megarl) Fused bias-SwiGLU where the spec allows it (Transformer Engine only)."""
    apply_rope_fusion: bool = True
    """(megarl) Fused RoPE kernel where the spec allows it (Transformer Engine only)."""
    gradient_accumulation_fusion: bool = True
    """(megarl) Weight-gradient GEMMs accumulate into fp32 main grads (TE, with apex's kernel)."""
    deallocate_pipeline_outputs: bool = True
    """(megarl) Free a stage's output activations once sent on (PP > 1 only)."""
    override_ddp_config: DDPConfig = field(default_factory=DDPConfig)
    """Megatron DDP settings: gradient-reduce and parameter-gather overlap, bucket size."""
    use_dist_checkpointing: bool = False
    """Initial weights from dist_checkpointing_path, not model.path (config, tokenizer: still)."""
    dist_checkpointing_path: str | None = None
    """A Megatron distributed checkpoint (`megarl convert hf-to-megatron`), saved at any TP×PP."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """Routing replay (MoE actor only)."""
    seed: int | None = None
    """Megatron's seed; megarl seeds with trainer.seed, so only unset or equal to it is accepted."""
    use_mbridge: bool = True
    """No effect, either value: megarl maps HF weights to Megatron itself (verl: mbridge or not)."""
    vanilla_mbridge: bool = True
    """No effect, either value (verl: mbridge or NVIDIA's Megatron-Bridge)."""
    dtype: str | None = None
    """verl's parameter dtype; megarl's is trainer.dtype: unset or naming it (bfloat16 for bf16)."""
    entropy_from_logits_with_chunking: bool = False
    """No effect, either value: the vocab-parallel entropy is always computed in chunks."""
    entropy_from_logits_chunk_size: int = 2048
    """No effect, any value (megarl chooses its chunks)."""
    use_megatron_fsdp: bool = False
    """Only false: Megatron DDP with the distributed optimizer."""
    override_mcore_model_config: dict[str, Any] = field(default_factory=dict)
    """Only empty: TransformerConfig fields go in override_transformer_config."""
    use_remove_padding: bool | None = None
    """verl's engine key for packing; null: the model section's use_remove_padding."""
    forward_only: bool = False
    """verl's per-role flag: actor and critic only false; the reference: either (forward-only)."""
    dist_checkpointing_prefix: str = ""
    """Only empty: checkpoint keys are the model's own, unprefixed."""
    dist_ckpt_optim_fully_reshardable: bool = False
    """No effect, either value: optimizer checkpoints are always fully reshardable."""
    distrib_optim_fully_reshardable_mem_efficient: bool = False
    """No effect, either value: optimizer checkpoints are always fully reshardable."""

    def parallel_layout(self) -> ParallelLayout:
        """The grid sizes and the layer split (override_transformer_config) as one layout."""
        return ParallelLayout(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            sequence_parallel=self.sequence_parallel,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            **{
                key: self.override_transformer_config[key]
                for key in PIPELINE_SPLIT_FIELDS
                if key in self.override_transformer_config
            },
        )


def _following_megatron(offload: bool = False) -> MegatronConfig:
    """A critic's or reference's ``megatron`` section: the keys it shares with the actor's
    unset (None) until :func:`megarl.config.loader.resolve_config` copies the actor's."""
    following = {key: None for key in SHARED_MEGATRON_KEYS}
    if offload:
        following["param_offload"] = None
    return MegatronConfig(**following)


@dataclass
class PolicyLossConfig:
    """``actor_rollout_ref.actor.policy_loss.*``."""

    loss_mode: PolicyLossMode = "vanilla"
    """verl's loss modes: vanilla (PPO clip), gpg, gspo, sapo, cispo, geo_mean, dppo_*, *_cov, dro."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of tokens whose gradient is dropped (> 0)."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance of a candidate token."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the covariance of a candidate token."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of tokens (largest covariance) given the KL penalty (> 0)."""
    ppo_kl_coef: float = 0.1
    """kl_cov: weight of the |log-ratio| penalty on the selected tokens."""
    dro_beta: float | None = None
    """dro: weight of the quadratic log-ratio penalty; required (> 0) for loss_mode=dro."""


@dataclass
class ActorConfig:
    """``actor_rollout_ref.actor.*``: the policy and its PPO update."""

    strategy: Literal["megatron"] = "megatron"
    """Training backend; megarl has only Megatron (accepted for verl scripts)."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step; the mini-batch holds this x rollout.n responses."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Responses per forward/backward pass on one GPU (required unless use_dynamic_bsz)."""
    use_dynamic_bsz: bool = False
    """Pack micro-batches up to ppo_max_token_len_per_gpu tokens instead of a fixed count."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch on one GPU with use_dynamic_bsz."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    shuffle: bool = False
    """Shuffle responses between mini-batches."""
    clip_ratio: float = 0.2
    """PPO clip range epsilon; default for clip_ratio_low/high."""
    clip_ratio_low: float | None = None
    """Lower clip range (ratio >= 1 - clip_ratio_low); unset: clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip range (ratio <= 1 + clip_ratio_high; DAPO clip-higher); unset: clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (must be > 1); dppo_*: IS truncation bound."""
    tau_pos: float = 1.0
    """sapo: gate temperature for tokens with positive advantage (> 0)."""
    tau_neg: float = 1.05
    """sapo: gate temperature for tokens with advantage <= 0 (> 0)."""
    calculate_sum_pi_squared: bool = False
    """Compute sum_v pi(v)^2 per token with the old log-probs (optimal_token_baseline needs it)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How token losses are averaged into the batch loss."""
    loss_scale_factor: float | None = None
    """Divisor for seq-mean-token-sum-norm; null: max_response_length."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add a KL(actor || ref) term to the loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: KLType = "low_var_kl"
    """KL estimator of the KL loss (kl/k1, abs, mse/k2, low_var_kl/k3, full; "+": k2 grad)."""
    policy_loss: PolicyLossConfig = field(default_factory=lambda: PolicyLossConfig())
    """Which policy loss."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer of the actor."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What the actor's checkpoints hold and what a resume loads."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout of the actor; critic and ref default to it."""
    use_torch_compile: bool = True
    """No effect, either value: verl's Megatron engine does not read it (its FSDP engine does)."""
    entropy_from_logits_with_chunking: bool = False
    """No effect, either value: the vocab-parallel entropy is always computed in chunks."""
    entropy_from_logits_chunk_size: int = 2048
    """No effect, any value (megarl chooses its chunks)."""
    rollout_n: int | None = None
    """Only unset or equal to actor_rollout_ref.rollout.n (verl's interpolated default)."""
    use_fused_kernels: bool = False
    """No effect, either value (as actor_rollout_ref.model.use_fused_kernels)."""
    freeze_vision_tower: bool = False
    """A vision-language actor: the vision tower (merger included) stays fixed; text models: false."""
    data_loader_seed: int | None = None
    """Only unset or trainer.seed: megarl's one seed."""
    ppo_micro_batch_size: int | None = None
    """Only null: verl's deprecated global micro-batch size; use ppo_micro_batch_size_per_gpu."""


@dataclass
class RefConfig:
    """``actor_rollout_ref.ref.*``: the frozen reference policy (used by KL loss/penalty)."""

    strategy: Literal["megatron"] = "megatron"
    """Backend; megarl has only Megatron (accepted for verl scripts)."""

    log_prob_micro_batch_size_per_gpu: int | None = None
    """Responses per forward pass for ref log-probs; unset: the rollout's."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Ref log-prob passes packed by token budget; unset: the rollout's."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Token budget of one ref log-prob micro-batch; unset: the rollout's."""
    megatron: MegatronConfig = field(default_factory=lambda: _following_megatron(offload=True))
    """Parallel layout of the reference; sizes follow the actor's and must match it."""
    use_torch_compile: bool = True
    """No effect, either value: verl's Megatron engine does not read it (its FSDP engine does)."""
    entropy_from_logits_with_chunking: bool = False
    """No effect, either value: the vocab-parallel entropy is always computed in chunks."""
    entropy_from_logits_chunk_size: int = 2048
    """No effect, any value (megarl chooses its chunks)."""
    rollout_n: int | None = None
    """Only unset or equal to actor_rollout_ref.rollout.n (verl's interpolated default)."""
    log_prob_micro_batch_size: int | None = None
    """Only null: verl's deprecated global micro-batch size; use log_prob_micro_batch_size_per_gpu."""


@dataclass
class ActorRolloutRefConfig:
    """``actor_rollout_ref.*``: policy, rollout engine and reference share one model."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy's HF model."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy training."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation with vLLM."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy."""
    hybrid_engine: bool = True
    """true; false (the async recipes) only with the rollout's own ranks (rollout.nnodes > 0)."""
    nccl_timeout: float | None = None
    """Collective timeout in seconds; null: $MEGARL_DIST_TIMEOUT_MINUTES, else 180 minutes."""


# ---------------------------------------------------------------------------------------------
# critic, algorithm, rewards, trainer
# ---------------------------------------------------------------------------------------------


@dataclass
class CriticConfig:
    """``critic.*``: the value model (PPO/GAE)."""

    enable: bool | None = None
    """Train a critic; null: exactly when algorithm.adv_estimator is gae."""
    strategy: Literal["megatron"] = "megatron"
    """Training backend; megarl has only Megatron."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The critic's HF model (a value head is added); path unset: the actor's."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer of the critic."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What the critic's checkpoints hold and what a resume loads."""
    megatron: MegatronConfig = field(default_factory=_following_megatron)
    """Parallel layout; parallel sizes default to the actor's and must match it."""
    ppo_mini_batch_size: int | None = None
    """Prompts per critic mini-batch; unset: the actor's."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Responses per forward/backward pass on one GPU; unset: the actor's."""
    use_dynamic_bsz: bool | None = None
    """Pack micro-batches by token budget; unset: the actor's."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget of one critic update micro-batch with use_dynamic_bsz."""
    forward_max_token_len_per_gpu: int | None = None
    """Token budget of one value-pass micro-batch; unset: ppo_max_token_len_per_gpu."""
    ppo_epochs: int | None = None
    """Passes over each rollout batch; unset: the actor's."""
    cliprange_value: float = 0.5
    """Value clip range."""
    loss_agg_mode: LossAggMode | None = None
    """Aggregation of the value loss; unset: the actor's."""
    nccl_timeout: float | None = None
    """One timeout per run: unset or equal to actor_rollout_ref.nccl_timeout."""
    rollout_n: int | None = None
    """Only unset or equal to actor_rollout_ref.rollout.n (verl's interpolated default)."""
    data_loader_seed: int | None = None
    """Only unset or trainer.seed: megarl's one seed."""
    ppo_micro_batch_size: int | None = None
    """Only null: verl's deprecated global micro-batch size; use ppo_micro_batch_size_per_gpu."""


@dataclass
class KLCtrlConfig:
    """``algorithm.kl_ctrl.*``: coefficient of the KL penalty in the reward."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or adaptive (Ziegler et al.) towards target_kl."""
    kl_coef: float = 0.001
    """(Initial) KL coefficient."""
    horizon: int = 10000
    """Adaptive controller horizon."""
    target_kl: float = 0.1
    """Adaptive controller target."""


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction.*``: which log-probs anchor the PPO ratio, and importance
    weights for the rollout/trainer mismatch (``megarl.algo.rollout_correction``)."""

    bypass_mode: bool = False
    """false: recompute old log-probs with the actor (decoupled); true: use vLLM's (bypass)."""
    rollout_is: RolloutIsLevel | None = None
    """Truncated IS weights min(pi_old / pi_rollout, threshold) per token or sequence; null: off."""
    rollout_is_threshold: float = 2.0
    """Upper truncation bound of the IS weights."""
    rollout_is_batch_normalize: bool = False
    """Rescale the IS weights to mean 1 over the batch."""
    rollout_rs: str | None = None
    """Rejection sampling; only null (off) is supported."""
    rollout_rs_threshold: float | None = None
    """Rejection-sampling threshold; only null is supported."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Loss in bypass mode; only ppo_clip (the ratio carries the correction) is supported."""


@dataclass
class AlgorithmConfig:
    """``algorithm.*``: advantage estimation and KL-in-reward."""

    adv_estimator: AdvEstimator = "gae"
    """Advantage estimator (gae needs a critic; group estimators need rollout.n >= 2)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's std (false: Dr.GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract a KL(actor || ref) penalty from the token rewards."""
    kl_penalty: KLType = "kl"
    """KL estimator of the in-reward penalty."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    """KL coefficient controller."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Old log-probs (decoupled or bypass) and rollout importance weights."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling: drop groups without variance, generate until the batch is full."""
    gdpo_reward_keys: list[str] | None = None
    """gdpo: the reward components (keys of the scorer's returned dict), each normalised alone."""
    gdpo_reward_weights: list[float] | None = None
    """gdpo: one weight per gdpo_reward_keys entry; null: 1 each."""


@dataclass
class TrainerConfig:
    """``trainer.*``: the run: cluster shape, schedule, logging, checkpoints."""

    nnodes: int = 1
    """Nodes."""
    n_gpus_per_node: int = 8
    """Processes (GPUs) per node; world size = nnodes x n_gpus_per_node."""
    device: Literal["cuda", "cpu"] = "cuda"
    """Device type; cpu runs the same code with gloo and the CPU emulation layer."""
    seed: int = 42
    """(megarl) Global seed (model init, sampling, data order)."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """(megarl) Parameter/compute dtype of training and rollout."""
    total_epochs: int = 30
    """Epochs over the training prompts."""
    total_training_steps: int | None = None
    """Stop after this many steps; null: total_epochs x steps per epoch."""
    project_name: str = "verl_examples"
    """MLflow experiment; wandb project."""
    experiment_name: str = "gsm8k"
    """MLflow and wandb run name."""
    logger: list[str] = field(default_factory=lambda: ["console"])
    """Metric sinks: console, mlflow, wandb, tensorboard (the last two: optional extras)."""
    tracking_uri: str | None = None
    """(megarl) MLflow URI; null: $MLFLOW_TRACKING_URI, else SQLite in the run dir (1 node only)."""
    log_val_generations: int = 0
    """Validation samples (verl's choice) appended per validation to <run dir>/val_generations.jsonl."""
    rollout_data_dir: str | None = None
    """Directory of per-step JSON-lines dumps of scored rollouts; null: none."""
    validation_data_dir: str | None = None
    """Directory of JSON-lines dumps of scored validation generations; null: none."""
    save_freq: int = -1
    """Checkpoint every this many steps; -1: never."""
    test_freq: int = -1
    """Validate every this many steps; -1: never."""
    val_before_train: bool = True
    """Validate once before the first step."""
    critic_warmup: int = 0
    """The actor trains from step critic_warmup on (verl's count: critic_warmup - 1 critic-only steps)."""
    balance_batch: bool = True
    """Give every DP rank a similar token count within each mini-batch (membership unchanged)."""
    max_consecutive_skipped_steps: int = 10
    """(megarl) Abort after this many steps in a row with a non-finite gradient; 0: never."""
    skip_weight_sync_steps: list[int] = field(default_factory=list)
    """(megarl) Steps whose weight sync is skipped on purpose (tests the rollout/logprob_diff_*)."""
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Checkpoints and run directory: metrics.jsonl, STOP file (${...} refers to other keys)."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """auto: latest in default_local_dir; resume_path: resume_from_path; disable: fresh."""
    resume_from_path: str | None = None
    """Checkpoint to resume from (resume_mode resume_path)."""
    max_actor_ckpt_to_keep: int | None = None
    """Keep at most this many actor checkpoints; null: all."""
    max_critic_ckpt_to_keep: int | None = None
    """Keep at most this many critic checkpoints; null: all."""
    default_hdfs_dir: str | None = None
    """Only null: checkpoints are local (default_local_dir)."""
    del_local_ckpt_after_load: bool = False
    """Only false: checkpoints are kept after a resume loads them."""
    val_only: bool = False
    """Only false: validation-only runs are not supported yet."""
    use_v1: bool = True
    """No effect, either value: megarl has one trainer (verl: its engine-worker trainer)."""


@dataclass
class MegarlConfig:
    """The whole run."""

    model_engine: str = "megatron"
    """verl 0.9's training-engine switch; megarl is the Megatron engine: only megatron."""

    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and batch size."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """Policy model, its training, rollout and reference."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and KL-in-reward."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Learned reward model."""
    custom_reward_function: CustomRewardFunctionConfig = field(
        default_factory=CustomRewardFunctionConfig
    )
    """User reward function."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run settings."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """Rollout overlapping training (vLLM on ranks of its own)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """verl 0.9's reward section (the same settings as reward_model.* and custom_reward_function.*)."""
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    """verl's older spelling of reward.sandbox_fusion.* (the same three settings)."""
    rollout: RolloutResourcesConfig = field(default_factory=RolloutResourcesConfig)
    """The async recipes' spelling of actor_rollout_ref.rollout.nnodes / n_gpus_per_node."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """verl 0.9's on-policy distillation from teacher models (not built yet: enabled is refused)."""
