"""``actor_rollout_ref.rollout.*``: the vLLM engine and its sampling settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class SamplingConfig:
    """``actor_rollout_ref.rollout.val_kwargs.*`` (megarl's place for validation sampling)."""

    temperature: float = 0.0
    """Sampling temperature of validation rollouts (ignored when do_sample is false)."""
    top_p: float = 1.0
    """Nucleus sampling of validation rollouts."""
    top_k: int = -1
    """Top-k of validation rollouts; -1: off."""
    n: int = 1
    """Responses per validation prompt."""
    do_sample: bool = False
    """Sample (true) or decode greedily (false) during validation."""


@dataclass
class MultiTurnConfig:
    """``actor_rollout_ref.rollout.multi_turn.*``: multi-turn rollouts with tool calls and
    interactions (verl 0.9.1's names, but interactions are megarl's extension: 0.9.1 has none;
    :mod:`megarl.rollout.multi_turn`, docs/tools.md)."""

    enable: bool = False
    """Alternate model turns with tool / interaction turns (verl's tool agent loop)."""
    max_assistant_turns: int | None = None
    """Most model turns per trajectory; unset: no limit (the response budget ends it)."""
    max_user_turns: int | None = None
    """Most tool / interaction turns per trajectory; unset: no limit."""
    max_parallel_calls: int = 1
    """Calls of one model turn that run (the first ones; the rest get no answer)."""
    max_tool_response_length: int = 256
    """Characters of a tool's answer kept (truncated beyond, with a marker)."""
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    """Which part of a long tool answer is dropped: left keeps the end, right the start."""
    tool_config_path: str | None = None
    """verl's tool config YAML (tools with class_name, config, tool_schema)."""
    function_tool_path: str | None = None
    """A Python file of @function_tool functions (schemas from signature and docstring)."""
    interaction_config_path: str | None = None
    """Interaction config YAML (scripted user turns): megarl's extension, verl 0.9.1 has none."""
    format: str = "hermes"
    """Tool-call format of the model's text (hermes: <tool_call>{...}</tool_call>)."""
    tokenization_sanity_check_mode: Literal["strict", "ignore_strippable", "disable"] = "strict"
    """Check each trajectory's ids against a re-rendering (mismatches: a warning, a metric)."""
    use_inference_chat_template: bool = False
    """verl's switch for Qwen3's thinking-stripping template; only false is built."""
    num_repeat_rollouts: int | None = None
    """verl's (SGLang-only) repeat count; only unset is accepted."""
    tool_call_timeout_s: float | None = 60.0
    """(megarl) Seconds one call may run (create + execute) before it times out; null: none."""


@dataclass
class CheckpointEngineConfig:
    """``actor_rollout_ref.rollout.checkpoint_engine.*``: how the actor's weights reach the
    rollout engine (verl's section). megarl's weight sync is verl's ``naive`` backend: the
    resharding plan's buckets over torch.distributed into the colocated engine."""

    backend: str = "naive"
    """Only naive: megarl's resharding streams buckets (verl's nccl/nixl/... engines: not built)."""
    update_weights_bucket_megabytes: int | None = None
    """Bytes of one sync bucket, in MiB (verl's default 2048); null: megarl's 1024."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Only empty: the naive backend takes no arguments."""
    custom_backend_module: str | None = None
    """Only null: no custom checkpoint engines."""

    def bucket_bytes(self) -> int | None:
        """The sync's bucket size in bytes (None: megarl's default)."""
        mb = self.update_weights_bucket_megabytes
        return None if mb is None else mb << 20


@dataclass
class RolloutConfig:
    """``actor_rollout_ref.rollout.*``: the vLLM engine colocated with training.

    vLLM always reports processed (temperature-scaled) log-probs; how they are used is
    ``algorithm.rollout_correction``.
    """

    name: Literal["vllm", "actor"] = "vllm"
    """Rollout engine: vllm, or (megarl) actor: sample from the Megatron actor itself (tests)."""
    # verl 0.9.1 accepts only async (its agent-loop rollout servers; sync raises "removed").
    # Deliberate difference: megarl also takes sync, which older verl scripts pass, and both mean
    # in-process vLLM generating each step's batch between training phases (on-policy, colocated).
    mode: Literal["async", "sync"] = "async"
    """async (verl 0.9.1's only mode) or sync (its older name): colocated, on-policy, per step."""
    tensor_model_parallel_size: int = 2
    """vLLM tensor-parallel size (independent of training TP); rollout DP = world / this."""
    expert_parallel_size: int = 1
    """vLLM expert parallelism: 1, or the rollout TP size (each rank then holds whole experts)."""
    nnodes: int = 0
    """Nodes of rollout-only ranks after the training ranks; 0: vLLM shares the training ranks."""
    n_gpus_per_node: int | None = None
    """Rollout-only ranks per node (with nnodes > 0); unset: trainer.n_gpus_per_node."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may use (weights + KV cache)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts; log-probs are computed at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling; < 1 needs allow_non_unit_top_p_top_k."""
    top_k: int = -1
    """Top-k sampling; -1 (or 0): off; otherwise needs allow_non_unit_top_p_top_k."""
    n: int = 1
    """Responses per prompt (the group size of GRPO and its family)."""
    do_sample: bool = True
    """Sample (true) or decode greedily (false)."""
    prompt_length: int | None = None
    """Longest prompt vLLM is given; unset: data.max_prompt_length."""
    response_length: int | None = None
    """Most tokens generated per response; unset: data.max_response_length."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Responses per old-log-prob forward pass; unset: actor.ppo_micro_batch_size_per_gpu."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Old-log-prob passes packed by token budget; unset: actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Token budget of one old-log-prob micro-batch; unset: actor.ppo_max_token_len_per_gpu."""
    max_num_seqs: int = 256
    """vLLM max_num_seqs (concurrent sequences)."""
    max_num_batched_tokens: int = 8192
    """vLLM max_num_batched_tokens (tokens per scheduler step)."""
    enable_chunked_prefill: bool = True
    """vLLM chunked prefill (off on CPU: vLLM 0.32 fails on a seeded partial prefill)."""
    enable_prefix_caching: bool = True
    """vLLM prefix caching (the n samples of a prompt share its KV); off under routing replay R3."""
    enable_rollout_routing_replay: bool = False
    """verl's rollout switch for routing replay R3 (megarl: implied by R3; true without it refused)."""
    logprobs_mode: str = "processed_logprobs"
    """Only processed_logprobs: vLLM reports log-probs after temperature scaling."""
    skip_tokenizer_init: bool = True
    """Only true: prompts reach vLLM as token ids and responses leave as token ids."""
    ignore_eos: bool = False
    """Only false: training rollouts stop at EOS."""
    over_sample_rate: float = 0.0
    """Only 0: no over-sampling (every request's response is kept)."""
    data_parallel_size: int = 1
    """Only 1: each vLLM engine is one TP group; rollout DP = rollout ranks / rollout TP."""
    pipeline_model_parallel_size: int = 1
    """Only 1: vLLM runs tensor-parallel only."""
    multi_stage_wake_up: bool = False
    """Only false: vLLM wakes up weights and KV cache in one stage."""
    calculate_log_probs: bool = False
    """No effect, either value: vLLM's log-probs of the sampled tokens are always kept."""
    log_prob_micro_batch_size: int | None = None
    """Only null: verl's deprecated global micro-batch size; use log_prob_micro_batch_size_per_gpu."""
    load_format: str = "dummy"
    """dummy, auto or safetensors: vLLM starts from model.path, then the actor's weights arrive."""
    layered_summon: bool = False
    """No effect, either value (verl: FSDP gathers layer by layer); weights travel in buckets."""
    disable_log_stats: bool = True
    """Only true: vLLM's statistics are not logged (its logs go to a file)."""
    quantization: str | None = None
    """Only null: rollout weights are not quantized."""
    quantization_config_file: str | None = None
    """Only null: rollout weights are not quantized."""
    free_cache_engine: bool = True
    """Put vLLM to sleep (free weights and KV cache) while training runs."""
    max_model_len: int | None = None
    """(megarl) vLLM max_model_len; null: prompt_length + response_length."""
    enforce_eager: bool = False
    """(megarl) vLLM enforce_eager (no CUDA graphs; slower, starts faster)."""
    kv_cache_memory_bytes: int | None = None
    """(megarl) vLLM KV-cache size in bytes; overrides gpu_memory_utilization (set it on CPU)."""
    limit_images: int | None = None
    """The most images a prompt may hold (vLLM's limit_mm_per_prompt); null: vLLM's 999."""
    allow_non_unit_top_p_top_k: bool = False
    """(megarl) Permit top_p < 1 or top_k > 0 in training rollouts (biased log-probs)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Free-form: extra keyword arguments for vllm.LLM."""
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    """How the actor's weights reach vLLM: the sync's bucket size."""
    moe_tensor_parallel_size: int | None = None
    """Only unset or tensor_model_parallel_size: vLLM splits its experts over its TP."""
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    """(megarl) Sampling settings of validation rollouts."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tools and interactions (verl's names)."""
