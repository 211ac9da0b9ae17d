"""Validation before anything distributed starts: every problem, each naming its keys and values.

``validate(cfg, world_size)`` raises one ``ConfigError`` listing all errors and returns the
warnings. The layout and batch-size checks live in :mod:`~megarl.config.layout_checks`; this
module holds the entry point and the checks of ranges, sampling, algorithm, rewards, trainer and
files.
"""

from __future__ import annotations

from pathlib import Path

from megarl.config.algo_inputs import unsupplied_inputs
from megarl.config.async_checks import check_async
from megarl.config.batch_plan import ACTOR, ARR, MEG, ROLL, critic_enabled
from megarl.config.choices import (
    GROUP_ESTIMATORS,
    LOGGERS,
    SEQUENCE_AGGREGATED_LOSSES,
    missing_logger_extras,
)
from megarl.config.dist_ckpt_checks import check_dist_checkpoints
from megarl.config.distillation_checks import check_distillation
from megarl.config.engine_key_checks import check_engine_keys
from megarl.config.errors import ConfigError
from megarl.config.layout_checks import LayoutChecks, fmt_value
from megarl.config.lora_checks import check_lora, check_lora_modules, check_lora_moe
from megarl.config.model_paths import resolve_model_paths
from megarl.config.model_source import ModelShape, is_remote, resolve_model_shape
from megarl.config.moe_checks import (
    check_moe,
    check_rollout_expert_parallel,
    check_router_losses,
    check_router_replay,
)
from megarl.config.multi_turn_checks import check_multi_turn
from megarl.config.recipe_checks import check_recipe_keys
from megarl.config.schema import MegarlConfig
from megarl.config.transformer_overrides import (
    split_follows_actor_problems,
    transformer_override_problems,
)
from megarl.config.vision_language_checks import check_vision_language

__all__ = ["validate"]


def _zero_dropout(key: str, value) -> bool:
    """An HF ``override_config`` entry megarl's models already satisfy: a dropout of 0 (the
    families megarl builds train without dropout)."""
    return ("dropout" in key or "pdrop" in key) and value in (0, 0.0)


def validate(
    cfg: MegarlConfig,
    world_size: int | None = None,
    *,
    check_paths: bool = False,
) -> list[str]:
    """Check ``cfg`` at ``world_size`` (default nnodes x n_gpus_per_node); return warnings.

    With ``check_paths`` (``megarl train``), missing local model and data files are errors;
    otherwise (validating a cluster config on a laptop) they are warnings. With ``check_paths``
    every model path key is also replaced in ``cfg`` by the local directory it names (a hub id by
    its snapshot in the HF cache; :mod:`megarl.config.model_paths`). Whether the config fits in
    GPU memory is the planner's question (:func:`megarl.planner.memory_warnings`).
    Raises ``ConfigError`` listing every problem found.
    """
    checks = _Checks(cfg, world_size, check_paths)
    checks.run()
    if checks.errors:
        raise ConfigError(checks.errors)
    return checks.warnings


class _Checks(LayoutChecks):
    """All checks of one config; ``run`` calls them in order."""

    def run(self) -> None:
        self.check_ranges()
        world = self.check_world()
        shape = self.check_model()
        if world:
            self.check_training_layout(world, shape)
            self.check_rollout_layout(world, shape)
            self.check_batches(world)
        self.check_shared_layouts()
        self.check_device()
        self.check_sampling()
        self.check_algorithm()
        self.check_policy_loss()
        self.check_rewards()
        self.check_trainer()
        check_dist_checkpoints(self.cfg, error=self.error, problem=self.problem)
        check_engine_keys(self.cfg, self.error)
        check_recipe_keys(self.cfg, self.error)
        check_multi_turn(self.cfg, self.error, self.problem)
        check_lora(self.cfg, self.error)
        check_vision_language(self.cfg, self.error)
        check_distillation(self.cfg, self.error, self.warn, check_paths=self.check_paths)
        self.check_not_applied()
        self.check_files()

    def check_override_config(self, key: str, overrides: dict) -> None:
        """HF config overrides megarl's models already satisfy: dropouts of 0, and a
        ``max_position_embeddings`` covering the sequence budget (the families megarl builds
        use RoPE, whose positions no table bounds; verl's scripts raise it so that its own
        check of ``rollout.max_model_len`` passes). Anything else is refused in one line."""
        c = self.cfg
        budget = max(c.data.max_prompt_length + c.data.max_response_length,
                     c.actor_rollout_ref.rollout.max_model_len or 0)  # fmt: skip
        for name, value in overrides.items():
            if _zero_dropout(name, value):
                continue
            if name == "max_position_embeddings":
                if not isinstance(value, int) or isinstance(value, bool) or value < budget:
                    self.error(
                        f"{key}.override_config.max_position_embeddings={fmt_value(value)} is "
                        f"below the sequence budget (data.max_prompt_length + "
                        f"data.max_response_length, or rollout.max_model_len) = {budget}; use "
                        f"{budget} or more, or leave it out"
                    )
                continue
            self.error(
                f"{key}.override_config.{name}={fmt_value(value)}: the model is built from "
                "config.json as is; only dropouts of 0 and max_position_embeddings >= the "
                "sequence budget are accepted"
            )

    # -- keys megarl reads but does not apply yet: refused rather than silently ignored --------
    def check_not_applied(self) -> None:
        c = self.cfg
        arr = c.actor_rollout_ref
        models = [("actor_rollout_ref.model", arr.model), ("critic.model", c.critic.model)]
        megatrons = [
            (f"{ACTOR}.megatron", arr.actor.megatron),
            ("actor_rollout_ref.ref.megatron", arr.ref.megatron),
            ("critic.megatron", c.critic.megatron),
        ]
        for k, m in models:
            self.check_override_config(k, m.override_config)
        for k, m in megatrons:
            for problem in transformer_override_problems(k, m.override_transformer_config):
                self.error(problem)
        for (k, m), required in zip(megatrons[1:], (False, critic_enabled(c))):
            for problem in split_follows_actor_problems(
                k, m, megatrons[0][0], arr.actor.megatron, required
            ):
                self.error(problem)
        refused: list[tuple[str, bool, str]] = [
            ("data.val_batch_size", c.data.val_batch_size is not None,
             "validation runs the whole set in one batch"),
        ]  # fmt: skip
        if arr.actor.megatron.virtual_pipeline_model_parallel_size is not None:
            # The interleaved schedule needs equal micro-batches; refused here, not after rollout.
            dynamic = [
                (f"{ACTOR}.use_dynamic_bsz", arr.actor.use_dynamic_bsz),
                (f"{ROLL}.log_prob_use_dynamic_bsz", arr.rollout.log_prob_use_dynamic_bsz),
                (
                    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
                    arr.ref.log_prob_use_dynamic_bsz,
                ),
                ("critic.use_dynamic_bsz", c.critic.use_dynamic_bsz),
            ]
            for key, on in dynamic:
                if on:
                    self.error(
                        f"{key}=true needs equal micro-batches, which the interleaved schedule "
                        f"({ACTOR}.megatron.virtual_pipeline_model_parallel_size) cannot take"
                    )
        for key, set_, why in refused:
            if set_:
                self.error(f"{key} is not supported yet ({why}): leave it at its default")

    # -- plain ranges ---------------------------------------------------------------------

    def check_ranges(self) -> None:
        c = self.cfg
        a, r = c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout
        for key, value in [
            ("data.train_batch_size", c.data.train_batch_size),
            ("data.max_prompt_length", c.data.max_prompt_length),
            ("data.max_response_length", c.data.max_response_length),
            (f"{ACTOR}.ppo_mini_batch_size", a.ppo_mini_batch_size),
            (f"{ACTOR}.ppo_epochs", a.ppo_epochs),
            ("critic.ppo_epochs", c.critic.ppo_epochs),
            (f"{ACTOR}.clip_ratio", a.clip_ratio),
            (f"{ACTOR}.clip_ratio_low", a.clip_ratio_low),
            (f"{ACTOR}.clip_ratio_high", a.clip_ratio_high),
            (f"{ROLL}.n", r.n),
            (f"{ROLL}.prompt_length", r.prompt_length),
            (f"{ROLL}.response_length", r.response_length),
            (f"{ROLL}.max_num_seqs", r.max_num_seqs),
            (f"{ROLL}.max_num_batched_tokens", r.max_num_batched_tokens),
            (f"{ROLL}.val_kwargs.n", r.val_kwargs.n),
            ("trainer.total_epochs", c.trainer.total_epochs),
        ]:
            self.positive(key, value)
        for key, value in [
            ("data.val_batch_size", c.data.val_batch_size),
            ("trainer.total_training_steps", c.trainer.total_training_steps),
            (f"{ROLL}.max_model_len", r.max_model_len),
            (f"{ROLL}.kv_cache_memory_bytes", r.kv_cache_memory_bytes),
            (f"{ROLL}.limit_images", r.limit_images),
            (f"{ACTOR}.loss_scale_factor", a.loss_scale_factor),
            ("reward_model.micro_batch_size_per_gpu", c.reward_model.micro_batch_size_per_gpu),
            ("reward_model.max_length", c.reward_model.max_length),
            ("trainer.max_actor_ckpt_to_keep", c.trainer.max_actor_ckpt_to_keep),
            ("trainer.max_critic_ckpt_to_keep", c.trainer.max_critic_ckpt_to_keep),
        ]:
            self.positive(key, value, allow_none=True)
        if a.clip_ratio_low >= 1:
            self.error(
                f"{ACTOR}.clip_ratio_low={a.clip_ratio_low} must be < 1 "
                "(the ratio's lower bound is 1 - clip_ratio_low)"
            )
        if a.clip_ratio_c <= 1:
            self.error(
                f"{ACTOR}.clip_ratio_c={a.clip_ratio_c} must be > 1 (dual-clip bound, as in verl)"
            )
        for key, value in [
            (f"{ACTOR}.entropy_coeff", a.entropy_coeff),
            (f"{ACTOR}.kl_loss_coef", a.kl_loss_coef),
            (f"{ACTOR}.optim.clip_grad", a.optim.clip_grad),
            ("critic.optim.clip_grad", c.critic.optim.clip_grad),
            (f"{ACTOR}.optim.lr_warmup_init", a.optim.lr_warmup_init),
            ("critic.optim.lr_warmup_init", c.critic.optim.lr_warmup_init),
            ("algorithm.kl_ctrl.kl_coef", c.algorithm.kl_ctrl.kl_coef),
            ("data.dataloader_num_workers", c.data.dataloader_num_workers),
            ("trainer.critic_warmup", c.trainer.critic_warmup),
            ("trainer.log_val_generations", c.trainer.log_val_generations),
        ]:
            if value < 0:
                self.error(f"{key} must be >= 0, got {fmt_value(value)}")
        for prefix, optim in [(f"{ACTOR}.optim", a.optim), ("critic.optim", c.critic.optim)]:
            if optim.lr < 0 or optim.min_lr < 0 or optim.weight_decay < 0:
                self.error(f"{prefix}.lr, min_lr and weight_decay must be >= 0")
            if optim.min_lr > optim.lr:
                self.error(f"{prefix}.min_lr={optim.min_lr} exceeds {prefix}.lr={optim.lr}")
            if optim.lr_warmup_steps < -1:
                self.error(
                    f"{prefix}.lr_warmup_steps must be -1 (use lr_warmup_steps_ratio) or >= 0, "
                    f"got {optim.lr_warmup_steps}"
                )
            if not 0 <= optim.lr_warmup_steps_ratio <= 1:
                self.error(
                    f"{prefix}.lr_warmup_steps_ratio must be in [0, 1], got "
                    f"{optim.lr_warmup_steps_ratio}"
                )
            if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
                self.error(f"{prefix}.betas must be two numbers in [0, 1), got {optim.betas}")
        for key, value in [
            ("algorithm.gamma", c.algorithm.gamma),
            ("algorithm.lam", c.algorithm.lam),
        ]:
            if not 0 <= value <= 1:
                self.error(f"{key} must be in [0, 1], got {value}")

    # -- world and layouts ----------------------------------------------------------------

    def check_sampling(self) -> None:
        r = self.cfg.actor_rollout_ref.rollout
        if r.temperature <= 0:
            self.error(
                f"{ROLL}.temperature={r.temperature} must be > 0 for training rollouts "
                "(log-probs are computed from logits / temperature)"
            )
        vllm_max = 2.0  # vLLM's SamplingParams refuses a temperature above 2 when asked
        for key, temp, sampled in ((f"{ROLL}.temperature", r.temperature, r.do_sample),
                                   (f"{ROLL}.val_kwargs.temperature", r.val_kwargs.temperature,
                                    r.val_kwargs.do_sample)):  # fmt: skip
            if r.name == "vllm" and sampled and temp > vllm_max:
                self.error(
                    f"{key}={temp:g}: vLLM samples at temperatures in [0, {vllm_max:g}] only; "
                    f"use at most {vllm_max:g} (or {ROLL}.name=actor, which has no limit)"
                )
        if not 0 < r.top_p <= 1:
            self.error(f"{ROLL}.top_p must be in (0, 1], got {r.top_p}")
        if r.top_k < -1:
            self.error(f"{ROLL}.top_k must be -1 (off) or >= 0, got {r.top_k}")
        truncated = [f"{ROLL}.top_p={r.top_p}"] if r.top_p < 1 else []
        truncated += [f"{ROLL}.top_k={r.top_k}"] if r.top_k > 0 else []
        if truncated and not r.allow_non_unit_top_p_top_k:
            self.error(
                f"{' and '.join(truncated)} {'truncate' if len(truncated) > 1 else 'truncates'} the sampling distribution, so the trainer's "
                "log-probs would not describe how responses were sampled; use top_p=1.0 and "
                f"top_k=-1 for training, or set {ROLL}.allow_non_unit_top_p_top_k=true to accept it"
            )
        if not r.do_sample:
            self.warn(f"{ROLL}.do_sample=false: training rollouts are greedy")
        if not 0 < r.gpu_memory_utilization <= 1:
            self.error(
                f"{ROLL}.gpu_memory_utilization must be in (0, 1], got {r.gpu_memory_utilization}"
            )
        needed = r.prompt_length + r.response_length
        if r.max_model_len is not None and r.max_model_len < needed:
            self.error(
                f"{ROLL}.max_model_len={r.max_model_len} is shorter than {ROLL}.prompt_length + "
                f"response_length = {r.prompt_length} + {r.response_length} = {needed}"
            )
        model_len = r.max_model_len or needed
        if not r.enable_chunked_prefill and r.max_num_batched_tokens < model_len:
            self.error(
                f"{ROLL}.max_num_batched_tokens={r.max_num_batched_tokens} is below the model "
                f"length {model_len} ({ROLL}.max_model_len or prompt_length + response_length); "
                f"vLLM needs it to be at least that when {ROLL}.enable_chunked_prefill=false"
            )
        v = r.val_kwargs
        if v.temperature < 0 or not 0 < v.top_p <= 1 or v.top_k < -1:
            self.error(
                f"{ROLL}.val_kwargs: temperature must be >= 0, top_p in (0, 1], top_k >= -1 "
                f"(got {v.temperature}, {v.top_p}, {v.top_k})"
            )
        if v.n > 1 and not v.do_sample:
            self.warn(
                f"{ROLL}.val_kwargs.n={v.n} with do_sample=false gives {v.n} identical responses"
            )

    def check_algorithm(self) -> None:
        c = self.cfg
        alg, a, r = c.algorithm, c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout
        est = alg.adv_estimator
        # Distilling without the task's rewards, no advantage of the estimator is used (verl's
        # on-policy-distillation script samples one response per prompt under grpo).
        distill = c.distillation.enabled and not c.distillation.distillation_loss.use_task_rewards
        if est in GROUP_ESTIMATORS and r.n < 2 and not distill:
            self.error(
                f"algorithm.adv_estimator={est} compares the responses to the same prompt and "
                f"needs {ROLL}.n >= 2, got {r.n}"
            )
        if est in GROUP_ESTIMATORS and not r.do_sample and r.n > 1:
            self.error(
                f"algorithm.adv_estimator={est} with {ROLL}.do_sample=false: the {r.n} greedy "
                "responses to a prompt are identical and every advantage is 0"
            )
        if est == "gae" and c.critic.enable is False:
            self.error("algorithm.adv_estimator=gae needs a critic, but critic.enable=false")
        if est != "gae" and c.critic.enable:
            self.warn(f"critic.enable=true but algorithm.adv_estimator={est} does not use values")
        if not critic_enabled(c) and c.trainer.critic_warmup > 0:
            self.warn(f"trainer.critic_warmup={c.trainer.critic_warmup} but there is no critic")
        if critic_enabled(c) and c.critic.cliprange_value <= 0:
            self.error(f"critic.cliprange_value must be > 0, got {c.critic.cliprange_value}")
        if a.use_kl_loss and alg.use_kl_in_reward:
            self.warn(
                f"{ACTOR}.use_kl_loss and algorithm.use_kl_in_reward are both true: the KL to the "
                "reference is penalised twice (verl recommends one of them)"
            )
        ctrl = alg.kl_ctrl
        if ctrl.type == "adaptive":
            if ctrl.target_kl <= 0 or ctrl.horizon <= 0:
                self.error(
                    "algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl > 0 and "
                    f"algorithm.kl_ctrl.horizon > 0 (got {ctrl.target_kl}, {ctrl.horizon})"
                )
            if not alg.use_kl_in_reward:
                self.warn(
                    "algorithm.kl_ctrl.type=adaptive has no effect unless "
                    "algorithm.use_kl_in_reward=true"
                )
        for key, value in [
            (f"{ACTOR}.kl_loss_type", a.kl_loss_type),
            ("algorithm.kl_penalty", alg.kl_penalty),
        ]:
            if value == "full":
                self.error(
                    f"unsupported: {key}=full (the exact KL needs both policies' full-vocabulary "
                    "log-distributions, which the vocab-parallel runner does not build; verl "
                    "raises for it too); use low_var_kl, kl, mse or abs"
                )
        self.check_rollout_correction()
        if a.loss_scale_factor is not None and a.loss_agg_mode != "seq-mean-token-sum-norm":
            self.warn(
                f"{ACTOR}.loss_scale_factor is only used by loss_agg_mode=seq-mean-token-sum-norm "
                f"(got {a.loss_agg_mode})"
            )

    def check_device(self) -> None:
        """Launching (paths checked) on ``trainer.device=cuda`` (verl's default) needs a GPU here.
        Sequence parallelism itself runs on either spec (the local one's norms are marked for it:
        :class:`megarl.models.gpt.TorchNorm`)."""
        if self.check_paths and self.cfg.trainer.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                self.error(
                    "trainer.device=cuda (verl's default) but this machine has no CUDA device: "
                    "set trainer.device=cpu to run on CPU"
                )

    def check_policy_loss(self) -> None:
        """The keys of the loss that `policy_loss.loss_mode` names (verl 0.9.1's names)."""
        a = self.cfg.actor_rollout_ref.actor
        pl, mode = a.policy_loss, a.policy_loss.loss_mode
        key = f"{ACTOR}.policy_loss"
        if mode == "dro" and (pl.dro_beta is None or pl.dro_beta <= 0):
            self.error(f"{key}.dro_beta must be set > 0 for loss_mode=dro, got {pl.dro_beta}")
        if mode == "kl_cov" and pl.kl_cov_ratio <= 0:
            self.error(f"{key}.kl_cov_ratio must be > 0, got {pl.kl_cov_ratio}")
        if mode == "clip_cov":
            if pl.clip_cov_ratio <= 0:
                self.error(f"{key}.clip_cov_ratio must be > 0, got {pl.clip_cov_ratio}")
            if pl.clip_cov_lb >= pl.clip_cov_ub:
                self.error(
                    f"{key}.clip_cov_lb={pl.clip_cov_lb} must be below "
                    f"{key}.clip_cov_ub={pl.clip_cov_ub}"
                )
        if mode == "sapo" and (a.tau_pos <= 0 or a.tau_neg <= 0):
            self.error(f"{ACTOR}.tau_pos and tau_neg must be > 0, got {a.tau_pos}, {a.tau_neg}")
        if mode in SEQUENCE_AGGREGATED_LOSSES and a.loss_agg_mode != "token-mean":
            self.warn(
                f"{ACTOR}.loss_agg_mode={a.loss_agg_mode} is ignored by {key}.loss_mode={mode}, "
                "which aggregates per sequence (as verl)"
            )
        # Each estimator and loss declares its inputs; the trainer's set is known (algo_inputs).
        for line in unsupplied_inputs(self.cfg):
            self.error(line)

    def check_rollout_correction(self) -> None:
        rc, key = self.cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
        if rc.rollout_rs is not None:
            self.error(
                f"unsupported: {key}.rollout_rs={rc.rollout_rs} (rejection sampling is not in "
                "megarl.algo); use rollout_is for truncated importance weights"
            )
        if rc.rollout_rs_threshold is not None:
            self.error(f"unsupported: {key}.rollout_rs_threshold (no rejection sampling)")
        if rc.loss_type != "ppo_clip":
            self.error(
                f"unsupported: {key}.loss_type={rc.loss_type} (megarl's bypass mode uses the "
                "PPO-clip loss, whose ratio carries the correction)"
            )
        if rc.rollout_is is not None:
            if rc.rollout_is_threshold <= 0:
                self.error(f"{key}.rollout_is_threshold must be > 0, got {rc.rollout_is_threshold}")
            elif rc.rollout_is_threshold < 1:
                self.warn(
                    f"{key}.rollout_is_threshold={rc.rollout_is_threshold} < 1 caps even "
                    "on-policy weights below 1"
                )
            if (
                rc.bypass_mode
                and self.cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"
            ):
                self.warn(
                    f"{key}.rollout_is={rc.rollout_is} with bypass_mode=true and the PPO-clip "
                    "loss: the ratio already is pi_theta / pi_rollout, so the weights would count "
                    "the correction twice and are not applied"
                )
            elif rc.bypass_mode:
                mode = self.cfg.actor_rollout_ref.actor.policy_loss.loss_mode
                self.error(
                    f"{key}.rollout_is={rc.rollout_is} with bypass_mode=true and "
                    f"{ACTOR}.policy_loss.loss_mode={mode} is not supported: bypass mode computes "
                    "no IS weights (only the PPO-clip loss carries the correction in its ratio)"
                )

    def check_rewards(self) -> None:
        rm, fn = self.cfg.reward_model, self.cfg.custom_reward_function
        if rm.enable and not rm.model.path:
            self.error("reward_model.enable=true needs reward_model.model.path")
        if rm.enable and fn.path is not None:
            self.error(
                "reward_model.enable=true with custom_reward_function.path: verl 0.9.1 scores "
                "with the custom function then and hands it the reward model as a server "
                "(generative RM), which megarl does not have; set only one"
            )
        if fn.path is not None and not fn.name:
            self.error(
                "custom_reward_function.name must name the function in custom_reward_function.path"
            )
        if fn.path and fn.path.endswith(".py") and not Path(fn.path).expanduser().is_file():
            self.problem(f"custom_reward_function.path={fn.path!r} does not exist")
        if rm.num_workers < 1:
            self.error(f"reward_model.num_workers must be >= 1, got {rm.num_workers}")
        if not rm.compute_score_timeout > 0:
            self.error(
                f"reward_model.compute_score_timeout must be > 0 seconds, got "
                f"{rm.compute_score_timeout}"
            )
        if rm.dump_samples < -1:
            self.error(f"reward_model.dump_samples must be -1 (all) or >= 0, got {rm.dump_samples}")
        from megarl.config.sandbox_fusion_checks import config_problems

        for problem in config_problems(self.cfg.reward.sandbox_fusion):
            self.error(problem)

    def check_trainer(self) -> None:
        t = self.cfg.trainer
        for key, value in [("trainer.save_freq", t.save_freq), ("trainer.test_freq", t.test_freq)]:
            if value == 0 or value < -1:
                self.error(f"{key} must be -1 (never) or a positive step count, got {value}")
        if t.resume_mode == "resume_path" and not t.resume_from_path:
            self.error("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        for role, ckpt in (
            (ACTOR, self.cfg.actor_rollout_ref.actor.checkpoint),
            ("critic", self.cfg.critic.checkpoint),
        ):
            self.check_checkpoint_contents(role, ckpt)
        unknown = [name for name in t.logger if name not in LOGGERS]
        if unknown:
            self.error(f"trainer.logger has {unknown}; megarl logs to {', '.join(LOGGERS)}")
        for line in missing_logger_extras(t.logger):
            self.error(line)
        if t.device == "cpu" and t.dtype == "bf16":
            self.warn("trainer.dtype=bf16 on trainer.device=cpu is slow; CPU configs use fp32")

    def check_checkpoint_contents(self, role: str, ckpt) -> None:
        """save_contents ⊆ {model, optimizer, extra, hf_model} with model; load_contents too."""
        for name, parts, allowed in (
            ("save_contents", ckpt.save_contents, ("model", "optimizer", "extra", "hf_model")),
            ("load_contents", ckpt.load_contents, ("model", "optimizer", "extra", "hf_model")),
        ):
            if parts is None:
                continue
            bad = [p for p in parts if p not in allowed]
            if bad:
                self.error(f"{role}.checkpoint.{name} has {bad}; choose from {list(allowed)}")
            elif "model" not in parts:
                self.error(f"{role}.checkpoint.{name}={parts} must include model")

    def check_model(self) -> ModelShape | None:
        c = self.cfg
        if not c.actor_rollout_ref.model.path:
            self.error(f"{ARR}.model.path is required (a local HF model directory or a hub id)")
            return None
        if self.check_paths:
            # Hub ids become their cached snapshot here, in the launcher and in every rank,
            # so vLLM, build_model and the tokenizer read one directory (megarl.config.model_paths).
            path_errors = resolve_model_paths(c)
            if path_errors:
                self.errors += path_errors
                return None
        shape, errors, warnings = resolve_model_shape(
            c.actor_rollout_ref.model, f"{ARR}.model", self.check_paths
        )
        self.errors += errors
        self.warnings += warnings
        check_moe(shape, f"{ARR}.model.path", MEG, c.actor_rollout_ref.actor.megatron, self.error)
        if shape is None or shape.get("num_experts"):
            check_router_losses(MEG, c.actor_rollout_ref.actor.megatron, self.error, self.warn)
        check_router_replay(c, shape, self.error)
        check_rollout_expert_parallel(c, shape, self.error)
        check_lora_moe(c, shape, self.error)
        check_lora_modules(c, shape, self.error, self.warn)
        check_async(c, self.error)
        self.check_gradient_checkpointing()
        critic = c.critic.model
        if critic_enabled(c) and critic.path and critic.path != c.actor_rollout_ref.model.path:
            critic_shape, errors, warnings = resolve_model_shape(
                critic, "critic.model", self.check_paths
            )
            self.errors += errors
            self.warnings += warnings
            check_moe(critic_shape, "critic.model.path", "critic.megatron", c.critic.megatron,
                      self.error)  # fmt: skip
            if critic_shape:
                meg = self.cfg.critic.megatron
                if meg.tensor_model_parallel_size > 0 and meg.pipeline_model_parallel_size > 0:
                    self.check_model_rule("critic.megatron", meg, critic_shape)
        return shape

    def check_gradient_checkpointing(self) -> None:
        """model.enable_gradient_checkpointing: accepted and inert, as on verl 0.9.1's Megatron
        engine; a warning when it is true and nothing else asks for recompute."""
        c = self.cfg
        roles = [(f"{ARR}.model", c.actor_rollout_ref.model, ACTOR, c.actor_rollout_ref.actor)]
        if critic_enabled(c):
            roles.append(("critic.model", c.critic.model, "critic", c.critic))
        for prefix, model, name, role in roles:
            if model.enable_gradient_checkpointing and role.megatron.recompute_granularity is None:
                self.warn(
                    f"{prefix}.enable_gradient_checkpointing=true recomputes nothing on the "
                    f"Megatron backend (as in verl 0.9.1); set {name}.megatron.recompute_granularity"
                )

    def check_files(self) -> None:
        data = self.cfg.data
        if not data.train_files:
            self.error("data.train_files is empty")
        t = self.cfg.trainer
        validates = t.test_freq > 0 or t.val_before_train
        if validates and not data.val_files:
            self.error(
                f"data.val_files is empty but validation is scheduled (trainer.test_freq="
                f"{t.test_freq}, trainer.val_before_train={fmt_value(t.val_before_train)})"
            )
        if t.save_freq > 0 and not t.default_local_dir:
            self.error(f"trainer.save_freq={t.save_freq} needs trainer.default_local_dir")
        if not self.check_paths:
            return
        checked = [("data.train_files", data.train_files)]
        if validates:
            checked.append(("data.val_files", data.val_files))
        for key, files in checked:
            for f in files:
                if not is_remote(f) and not Path(f).expanduser().exists():
                    self.error(f"{key}: {f!r} does not exist")

    def problem(self, message: str) -> None:
        """An error when paths are checked (``megarl train``), else a warning."""
        (self.error if self.check_paths else self.warn)(message)
