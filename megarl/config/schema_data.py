"""The ``data``, ``reward_model``, ``custom_reward_function`` and ``async_training`` sections of the
typed config tree (:mod:`megarl.config.schema` holds the rest and the root)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class DataConfig:
    """``data.*``: prompt datasets and the global batch size."""

    train_files: list[str] = field(default_factory=lambda: ["~/data/rlhf/gsm8k/train.parquet"])
    """Training parquet file(s); a single string is accepted."""
    val_files: list[str] = field(default_factory=lambda: ["~/data/rlhf/gsm8k/test.parquet"])
    """Validation parquet file(s); a single string is accepted."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a chat message list or a string)."""
    reward_fn_key: str = "data_source"
    """Column that selects the rule-based reward function."""
    max_prompt_length: int = 512
    """Longest prompt in tokens; longer prompts are filtered or truncated (see truncation)."""
    max_response_length: int = 512
    """Longest generated response in tokens."""
    train_batch_size: int = 1024
    """Prompts per step (x rollout.n responses); 0: ppo_mini_batch_size x require_batches."""
    gen_batch_size: int | None = None
    """Prompts per generation batch with algorithm.filter_groups (DAPO); null: train_batch_size."""
    val_batch_size: int | None = None
    """Prompts per validation batch; null: the whole validation set at once."""
    train_max_samples: int = -1
    """Use at most this many training prompts; -1: all."""
    val_max_samples: int = -1
    """Use at most this many validation prompts; -1: all."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch."""
    seed: int | None = None
    """Seed of the prompt shuffling; null: trainer.seed."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length instead of truncating them."""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """What to do with a prompt longer than max_prompt_length that was not filtered."""
    dataloader_num_workers: int = 8
    """Workers loading prompts (megarl: threads reading the parquet files; capped at the CPUs)."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Free-form: extra keyword arguments of tokenizer.apply_chat_template (e.g. enable_thinking)."""
    return_raw_chat: Any = True
    """verl's key; inert as in verl 0.9.1, whose dataset reads it and never uses it (any value)."""
    use_chat_template: bool = True
    """(megarl) Render prompts with the chat template; false: tokenise plain-string prompts as is."""
    trust_remote_code: bool = False
    """Load the actor's tokenizer (which tokenizes the data) with trust_remote_code."""
    # verl: trust_remote_code of the data's tokenizer and processor loads. megarl tokenizes the
    # data with the actor's tokenizer, loaded with it when this or
    # actor_rollout_ref.model.trust_remote_code is true.
    tool_config_path: str | None = None
    """Tools whose schemas the template gets when filter_overlong_prompts counts; null: the rollout's."""
    function_tool_path: str | None = None
    """Function tools the filter counts with, as tool_config_path; null: the rollout's."""
    image_key: str = "images"
    """Column of each row's images: a list of {"bytes": ...} dicts (geo3k), {"image": path} or paths."""
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    """Free-form: options of the model's image processor (min_pixels, max_pixels, size...)."""


# ---------------------------------------------------------------------------------------------
# actor_rollout_ref
# ---------------------------------------------------------------------------------------------


@dataclass
class RewardModelPathConfig:
    """``reward_model.model.*``: which reward model to load."""

    path: str | None = None
    """HF Llama/Qwen2 *ForSequenceClassification directory (num_labels=1, with its tokenizer)."""
    use_remove_padding: bool = True
    """Pack the scored sequences into one row per micro-batch without padding (THD)."""


@dataclass
class RewardModelMegatronConfig:
    """``reward_model.megatron.*`` (megarl; verl <= 0.8's Megatron reward model key): the reward
    model runs at the actor's TP×PP layout."""

    param_offload: bool = False
    """Keep the reward model's parameters in host memory between its passes (on GPU)."""


@dataclass
class RewardModelConfig:
    """``reward_model.*``: a learned reward model (optional) and the scoring workers.

    With ``enable``, every response is scored by the reward model *instead of* the rule scorers
    (verl 0.9.1's reward loop: a discriminative reward model replaces the data_source rules);
    ``custom_reward_function.path`` together with it is refused (verl hands the reward model to
    that function as a generative-RM server, which megarl does not have).
    """

    enable: bool = False
    """Score responses with the reward model at reward_model.model.path."""
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    """The reward model checkpoint."""
    megatron: RewardModelMegatronConfig = field(default_factory=RewardModelMegatronConfig)
    """(megarl) Offloading of the reward model."""
    micro_batch_size_per_gpu: int | None = None
    """Responses per reward-model forward pass on one GPU; null: the rollout's log-prob one."""
    max_length: int | None = None
    """Longest re-tokenised prompt + response scored (cut on the right); null: no limit."""
    num_workers: int = 2
    """Scoring worker processes per rank (rule and custom reward functions)."""
    compute_score_timeout: float = 30.0
    """(megarl) Per-sample scoring time limit, s (over it: score 0); code data may need ~110."""
    dump_samples: int = 16
    """(megarl) First samples per step written to the rollout/validation dumps; -1: all."""
    reward_manager: str | None = None
    """verl's older spelling of reward.reward_manager.name (naive, dapo, gdpo, prime); null: naive."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Free-form: verl's older spelling of reward.reward_kwargs (the DAPO overlong buffer)."""
    reward_loop_source: str | None = None
    """verl's older spelling of reward.reward_manager.source (register or importlib)."""
    reward_loop_module_path: str | None = None
    """verl's older spelling of reward.reward_manager.module.path."""
    reward_loop_class_name: str | None = None
    """verl's older spelling of the class of a user's reward manager (source importlib)."""


@dataclass
class CustomRewardFunctionConfig:
    """``custom_reward_function.*``: a user reward function."""

    path: str | None = None
    """A .py file or a dotted module path; null: built-in rule rewards by data_source."""
    name: str = "compute_score"
    """Function name in that file/module."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Free-form: extra keyword arguments passed to the function."""


@dataclass
class AsyncTrainingConfig:
    """``async_training.*`` (verl's fully-async recipe's names): rollout overlapping training,
    with vLLM on ranks of its own (``actor_rollout_ref.rollout.nnodes`` > 0)."""

    staleness_threshold: float = 0.0
    """0: on-policy; > 0: the staleness bound in updates, rounded up (1: one step off)."""
    trigger_parameter_sync_step: int = 1
    """Updates between weight syncs (megarl: 1 only)."""
    partial_rollout: bool = False
    """Interrupt rollouts at a weight sync and resume them after (megarl: false only)."""
    require_batches: int | None = None
    """Mini-batches per update with data.train_batch_size=0; null: 1 (verl's default)."""


@dataclass
class FilterGroupsConfig:
    """``algorithm.filter_groups.*``: DAPO's dynamic sampling. Groups whose ``metric`` is the same
    for every response (no variance; a group of one is kept) are dropped, and generation batches
    of ``data.gen_batch_size`` prompts follow until ``data.train_batch_size`` groups are kept."""

    enable: bool = False
    """Drop zero-variance groups and generate until the training batch is full."""
    metric: str | None = None
    """acc, score, seq_reward, seq_final_reward, or a field of the scorer's returned dict."""
    max_num_gen_batches: int = 0
    """Generation batches per step before the step fails; <= 0: no limit."""
    max_inflight_gen_batches: int = 1
    """Only 1: one generation batch at a time."""
