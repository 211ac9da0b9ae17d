"""Checks of verl keys whose value either is megarl's behaviour anyway or asks for something
megarl does not have: ``model_engine``,
``megatron.seed``, ``nccl_timeout``, ``optim.lr_decay_steps``,
``optim.override_optimizer_config`` and the keys of :data:`ONLY`. Each refusal is one line
naming the key and the values that work; keys accepted at any value (``use_mbridge``,
``use_fused_kernels``, ``rollout.calculate_log_probs``, ``optim.total_training_steps``,
``optim.lr_wsd_*``) say so in their docstrings and are not checked here.
"""

from __future__ import annotations

from collections.abc import Callable

from megarl.config.layout_checks import fmt_value
from megarl.config.loader import get_key
from megarl.config.optim_overrides import override_problems

Error = Callable[[str], None]

ARR = "actor_rollout_ref"
_OPTIMS = (f"{ARR}.actor.optim", "critic.optim")
_ROLES = (f"{ARR}.actor", f"{ARR}.ref", "critic")
_DTYPES = {
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
    "fp32": ("fp32", "float32", "torch.float32"),
}
"""trainer.dtype -> the names verl's dtype keys give it."""
_FP32 = _DTYPES["fp32"]
ONLY: tuple[tuple[str, tuple[object, ...], str], ...] = (
    *[(f"{o}.{k}", _FP32, "main gradients and Adam moments are fp32")
      for o in _OPTIMS for k in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")],
    *[(f"{o}.use_layer_wise_distributed_optimizer", (False,),
       "the distributed optimizer shards over data-parallel ranks") for o in _OPTIMS],
    *[(f"{r}.checkpoint.async_save", (False,), "saves are synchronous")
      for r in (f"{ARR}.actor", "critic")],
    (f"{ARR}.rollout.ignore_eos", (False,), "training rollouts stop at EOS"),
    (f"{ARR}.rollout.over_sample_rate", (0,), "no over-sampling"),
    (f"{ARR}.rollout.data_parallel_size", (1,),
     f"each vLLM engine is one TP group (more engines: more ranks or {ARR}.rollout.nnodes)"),
    (f"{ARR}.rollout.pipeline_model_parallel_size", (1,), "vLLM runs tensor-parallel only"),
    (f"{ARR}.rollout.multi_stage_wake_up", (False,), "vLLM wakes up in one stage"),
    (f"{ARR}.rollout.logprobs_mode", ("processed_logprobs",),
     "vLLM reports log-probs after temperature scaling"),
    (f"{ARR}.rollout.skip_tokenizer_init", (True,),
     "prompts reach vLLM as token ids and responses leave as token ids"),
    *[(f"{m}.{k}", (None,), why) for m in (f"{ARR}.model", "critic.model") for k, why in (
        ("external_lib", "no custom modelling code is imported"),
        ("custom_chat_template", "the tokenizer's own chat template is used"))],
    *[(f"{m}.{k}", (False,), why) for m in (f"{ARR}.model", "critic.model") for k, why in (
        ("use_shm", "models load from the filesystem"),
        ("enable_activation_offload", "no activation offloading"),
        ("use_liger", "no Liger kernels (fusions follow megatron.transformer_impl)"))],
    ("trainer.default_hdfs_dir", (None,), "checkpoints are local (trainer.default_local_dir)"),
    ("trainer.del_local_ckpt_after_load", (False,), "checkpoints are kept after a resume"),
    ("trainer.val_only", (False,), "validation-only runs are not supported yet"),
    *[(f"{r}.megatron.use_megatron_fsdp", (False,),
       "Megatron DDP with the distributed optimizer") for r in _ROLES],
    *[(f"{r}.megatron.override_mcore_model_config", ({},),
       f"TransformerConfig fields go in {r}.megatron.override_transformer_config") for r in _ROLES],
    *[(f"{r}.megatron.forward_only", (False,), "it trains (the reference is forward-only anyway)")
      for r in (f"{ARR}.actor", "critic")],
    *[(f"{r}.megatron.dist_checkpointing_prefix", ("",),
       "checkpoint keys are the model's own, unprefixed") for r in _ROLES],
    *[(f"{r}.checkpoint.strict", (True,), "a resumed checkpoint must hold every parameter")
      for r in (f"{ARR}.actor", "critic")],
    *[(f"{r}.ppo_micro_batch_size", (None,),
       "global micro-batch sizes are deprecated in verl; set ppo_micro_batch_size_per_gpu")
      for r in (f"{ARR}.actor", "critic")],
    *[(f"{r}.log_prob_micro_batch_size", (None,),
       "global micro-batch sizes are deprecated in verl; set log_prob_micro_batch_size_per_gpu")
      for r in (f"{ARR}.rollout", f"{ARR}.ref")],
    (f"{ARR}.rollout.load_format", ("dummy", "auto", "safetensors"),
     "vLLM starts from model.path's weights and then takes the actor's before generating"),
    (f"{ARR}.rollout.disable_log_stats", (True,), "vLLM's statistics are not logged"),
    (f"{ARR}.rollout.checkpoint_engine.backend", ("naive",),
     ("megarl's weight sync streams the resharding plan's buckets over torch.distributed "
      "(verl's naive backend)")),
    (f"{ARR}.rollout.checkpoint_engine.engine_kwargs", ({},), "the naive backend takes none"),
    (f"{ARR}.rollout.checkpoint_engine.custom_backend_module", (None,),
     "no custom checkpoint engines"),
    (f"{ARR}.rollout.quantization", (None,), "rollout weights are not quantized"),
    (f"{ARR}.rollout.quantization_config_file", (None,), "rollout weights are not quantized"),
    ("reward.reward_model.enable_resource_pool", (False,),
     "the reward model runs on Megatron at the actor's layout, on the same ranks"),
    ("reward.reward_model.nnodes", (0,), "the reward model has no nodes of its own"),
)  # fmt: skip
"""(key, the values that work, why): verl keys megarl accepts only at its own behaviour."""


def check_engine_keys(cfg, error: Error) -> None:
    """Report every engine key whose value megarl cannot honour through ``error``."""
    for key, works, why in ONLY:
        value = get_key(cfg, key)
        if value not in works or isinstance(value, bool) != isinstance(works[0], bool):
            shown = " or ".join(fmt_value(w) for w in works)
            error(f"{key}={fmt_value(value)}: {why}; use {shown}")
    arr = cfg.actor_rollout_ref
    if cfg.model_engine != "megatron":
        error(
            f"model_engine={cfg.model_engine}: megarl is the Megatron engine; use "
            "model_engine=megatron (or leave it out)"
        )
    roll = arr.rollout
    mb = roll.checkpoint_engine.update_weights_bucket_megabytes
    if mb is not None and mb < 1:
        error(
            f"{ARR}.rollout.checkpoint_engine.update_weights_bucket_megabytes must be >= 1, got {mb}"
        )
    moe_tp = roll.moe_tensor_parallel_size
    if moe_tp is not None and moe_tp != roll.tensor_model_parallel_size:
        error(
            f"{ARR}.rollout.moe_tensor_parallel_size={moe_tp}: vLLM splits the experts over its "
            f"tensor-parallel size ({roll.tensor_model_parallel_size}); use "
            f"{roll.tensor_model_parallel_size} or leave it unset (expert_parallel_size spreads them)"
        )
    seed = cfg.trainer.seed
    for key, meg in ((f"{ARR}.actor", arr.actor.megatron), (f"{ARR}.ref", arr.ref.megatron),
                     ("critic", cfg.critic.megatron)):  # fmt: skip
        if meg.seed is not None and meg.seed != seed:
            error(
                f"{key}.megatron.seed={meg.seed}: megarl seeds Megatron with trainer.seed "
                f"({seed}); use {seed}, leave it unset, or set trainer.seed={meg.seed}"
            )
    _check_timeout(cfg, error)
    for key, given in ((f"{ARR}.actor", arr.actor.data_loader_seed),
                       ("critic", cfg.critic.data_loader_seed)):  # fmt: skip
        if given is not None and given != seed:
            error(
                f"{key}.data_loader_seed={given}: megarl's one seed is trainer.seed ({seed}); use "
                f"{seed}, leave it unset, or set trainer.seed={given}"
            )
    for key, model in ((f"{ARR}.model", arr.model), ("critic.model", cfg.critic.model)):
        if model.hf_config_path not in (None, model.path):
            error(
                f"{key}.hf_config_path={model.hf_config_path}: megarl reads config.json from "
                f"{key}.path ({model.path}); leave it unset or equal to the path"
            )
    n = arr.rollout.n
    for key, given in ((f"{ARR}.actor", arr.actor.rollout_n), (f"{ARR}.ref", arr.ref.rollout_n),
                       ("critic", cfg.critic.rollout_n)):  # fmt: skip
        if given is not None and given != n:
            error(
                f"{key}.rollout_n={given}: responses per prompt are {ARR}.rollout.n ({n}); "
                f"use {n} or leave it unset"
            )
    dtype = cfg.trainer.dtype
    for key in [f"{r}.megatron.dtype" for r in _ROLES]:
        value = get_key(cfg, key)
        if value is not None and value not in _DTYPES[dtype]:
            other = next((k for k, names in _DTYPES.items() if value in names), None)
            instead = f", or set trainer.dtype={other}" if other else ""
            error(
                f"{key}={value}: megarl's dtype is trainer.dtype ({dtype}); use "
                f"{' or '.join(_DTYPES[dtype])} or leave it unset{instead}"
            )
    for key, optim in ((f"{ARR}.actor.optim", arr.actor.optim), ("critic.optim", cfg.critic.optim)):
        if optim.lr_decay_steps is not None and optim.lr_decay_steps < 1:
            error(
                f"{key}.lr_decay_steps must be a positive number or null, got {optim.lr_decay_steps}"
            )
        for problem in override_problems(
            f"{key}.override_optimizer_config", optim.override_optimizer_config
        ):
            error(problem)


def _check_timeout(cfg, error: Error) -> None:
    actor, critic = cfg.actor_rollout_ref.nccl_timeout, cfg.critic.nccl_timeout
    if actor is not None and actor <= 0:
        error(f"{ARR}.nccl_timeout must be a positive number of seconds or null, got {actor:g}")
    if critic is not None and critic != actor:
        instead = (
            f"set {ARR}.nccl_timeout={critic:g} instead"
            if actor is None
            else f"leave critic.nccl_timeout unset or equal to it ({actor:g})"
        )
        error(
            f"critic.nccl_timeout={critic:g}: megarl has one process-group timeout, "
            f"{ARR}.nccl_timeout; {instead}"
        )
