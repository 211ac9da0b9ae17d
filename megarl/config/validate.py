"""Validation before anything distributed starts: every problem, each naming its keys and values.

``validate(cfg, world_size)`` raises one ``ConfigError`` listing all errors and returns the
warnings. Layout arithmetic (world = nnodes x n_gpus_per_node; training DP = world / (TP x PP x
CP); rollout DP = world / rollout TP) is also exposed as ``layout(cfg)`` for summaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megarl.config.errors import ConfigError
from megarl.config.model_facts import ModelFacts, is_remote, resolve_model_facts
from megarl.config.schema import (
    GROUP_ESTIMATORS,
    LOGGERS,
    PARALLEL_KEYS,
    MegarlConfig,
    MegatronConfig,
)

ARR = "actor_rollout_ref"
ACTOR = f"{ARR}.actor"
MEG = f"{ACTOR}.megatron"
ROLL = f"{ARR}.rollout"
REF = f"{ARR}.ref"
WORLD = "trainer.nnodes × trainer.n_gpus_per_node"
_RECOMPUTE_MODULES = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe"}
_RECOMPUTE_MODULES |= {"shared_experts"}


@dataclass
class Layout:
    """World, training and rollout grid sizes implied by a config."""

    world_size: int
    """Processes: trainer.nnodes x trainer.n_gpus_per_node."""
    model_parallel_size: int
    """TP x PP x CP of the actor."""
    data_parallel_size: int
    """Training data-parallel size (0 when the world is not divisible)."""
    rollout_data_parallel_size: int
    """vLLM engines: world / rollout TP (0 when not divisible)."""


def layout(cfg: MegarlConfig, world_size: int | None = None) -> Layout:
    """Grid sizes of ``cfg`` at ``world_size`` (default: nnodes x n_gpus_per_node)."""
    meg = cfg.actor_rollout_ref.actor.megatron
    world = world_size or cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    mp = max(1, meg.tensor_model_parallel_size * meg.pipeline_model_parallel_size)
    mp *= max(1, meg.context_parallel_size)
    rtp = max(1, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
    return Layout(
        world_size=world,
        model_parallel_size=mp,
        data_parallel_size=world // mp if world % mp == 0 else 0,
        rollout_data_parallel_size=world // rtp if world % rtp == 0 else 0,
    )


def critic_enabled(cfg: MegarlConfig) -> bool:
    """critic.enable, or (when null) whether the estimator is gae."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae"


def ref_used(cfg: MegarlConfig) -> bool:
    """The reference policy is needed for a KL loss or a KL penalty in the reward."""
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def validate(
    cfg: MegarlConfig, world_size: int | None = None, *, check_paths: bool = False
) -> list[str]:
    """Check ``cfg`` at ``world_size`` (default nnodes x n_gpus_per_node); return warnings.

    With ``check_paths`` (``megarl train``), missing local model and data files are errors;
    otherwise (validating a cluster config on a laptop) they are warnings.
    Raises ``ConfigError`` listing every problem found.
    """
    checks = _Checks(cfg, world_size, check_paths)
    checks.run()
    if checks.errors:
        raise ConfigError(checks.errors)
    return checks.warnings


class _Checks:
    def __init__(self, cfg: MegarlConfig, world_size: int | None, check_paths: bool):
        self.cfg = cfg
        self.world_size = world_size
        self.check_paths = check_paths
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, message: str) -> None:
        self.errors.append(message)

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def run(self) -> None:
        self.check_ranges()
        world = self.check_world()
        facts = self.check_model()
        if world:
            self.check_training_layout(world, facts)
            self.check_rollout_layout(world, facts)
            self.check_batches(world)
        self.check_shared_layouts()
        self.check_sampling()
        self.check_algorithm()
        self.check_rewards()
        self.check_trainer()
        self.check_files()

    # -- plain ranges ---------------------------------------------------------------------

    def positive(self, key: str, value: float | None, allow_none: bool = False) -> bool:
        if value is None and allow_none:
            return True
        if value is None or value <= 0:
            self.error(f"{key} must be a positive number, got {_fmt(value)}")
            return False
        return True

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
            (f"{ACTOR}.loss_scale_factor", a.loss_scale_factor),
            ("reward_model.micro_batch_size_per_gpu", c.reward_model.micro_batch_size_per_gpu),
            ("reward_model.max_length", c.reward_model.max_length),
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
            (f"{ACTOR}.grad_clip", a.grad_clip),
            ("critic.grad_clip", c.critic.grad_clip),
            ("algorithm.kl_ctrl.kl_coef", c.algorithm.kl_ctrl.kl_coef),
            ("data.dataloader_num_workers", c.data.dataloader_num_workers),
            ("trainer.critic_warmup", c.trainer.critic_warmup),
            ("trainer.log_val_generations", c.trainer.log_val_generations),
        ]:
            if value < 0:
                self.error(f"{key} must be >= 0, got {_fmt(value)}")
        for prefix, optim in [(f"{ACTOR}.optim", a.optim), ("critic.optim", c.critic.optim)]:
            if optim.lr < 0 or optim.min_lr < 0 or optim.weight_decay < 0:
                self.error(f"{prefix}.lr, min_lr and weight_decay must be >= 0")
            if optim.min_lr > optim.lr:
                self.error(f"{prefix}.min_lr={optim.min_lr} exceeds {prefix}.lr={optim.lr}")
            if optim.warmup_steps < 0:
                self.error(f"{prefix}.warmup_steps must be >= 0, got {optim.warmup_steps}")
            if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
                self.error(f"{prefix}.betas must be two numbers in [0, 1), got {optim.betas}")
        for key, value in [
            ("algorithm.gamma", c.algorithm.gamma),
            ("algorithm.lam", c.algorithm.lam),
        ]:
            if not 0 <= value <= 1:
                self.error(f"{key} must be in [0, 1], got {value}")

    # -- world and layouts ----------------------------------------------------------------

    def check_world(self) -> int:
        t = self.cfg.trainer
        ok = self.positive("trainer.nnodes", t.nnodes) & self.positive(
            "trainer.n_gpus_per_node", t.n_gpus_per_node
        )
        if not ok:
            return 0
        configured = t.nnodes * t.n_gpus_per_node
        if self.world_size is not None and self.world_size != configured:
            self.error(
                f"world size {self.world_size} does not match {WORLD} = "
                f"{t.nnodes} × {t.n_gpus_per_node} = {configured}"
            )
            return 0
        return configured

    def check_megatron_ranges(self, prefix: str, meg: MegatronConfig) -> bool:
        ok = True
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            ok &= self.positive(f"{prefix}.{key}", getattr(meg, key))
        ok &= self.positive(f"{prefix}.context_parallel_size", meg.context_parallel_size)
        ok &= self.positive(f"{prefix}.expert_model_parallel_size", meg.expert_model_parallel_size)
        vpp = meg.virtual_pipeline_model_parallel_size
        if vpp is not None and (vpp < 2 or meg.pipeline_model_parallel_size < 2):
            self.error(
                f"{prefix}.virtual_pipeline_model_parallel_size={vpp} needs a value >= 2 and "
                f"{prefix}.pipeline_model_parallel_size >= 2 (got "
                f"{meg.pipeline_model_parallel_size}); use null for no interleaving"
            )
            ok = False
        self.check_recompute(prefix, meg)
        device = self.cfg.trainer.device
        if meg.transformer_impl == "transformer_engine" and device == "cpu":
            self.error(
                f"{prefix}.transformer_impl=transformer_engine needs CUDA but trainer.device=cpu; "
                "use local or auto"
            )
        if meg.context_parallel_size > 1 and (device == "cpu" or meg.transformer_impl == "local"):
            self.error(
                f"{prefix}.context_parallel_size={meg.context_parallel_size} needs Transformer "
                f"Engine attention (Megatron's local spec has no context parallelism), but "
                f"trainer.device={device}, {prefix}.transformer_impl={meg.transformer_impl}"
            )
        return ok

    def check_recompute(self, prefix: str, meg: MegatronConfig) -> None:
        gran, method, layers = (
            meg.recompute_granularity,
            meg.recompute_method,
            meg.recompute_num_layers,
        )
        if gran == "full" and (method is None or layers is None):
            self.error(
                f"{prefix}.recompute_granularity=full needs {prefix}.recompute_method (uniform or "
                f"block) and {prefix}.recompute_num_layers (got {_fmt(method)}, {_fmt(layers)})"
            )
        if gran != "full" and (method is not None or layers is not None):
            self.error(
                f"{prefix}.recompute_method and recompute_num_layers apply only with "
                f"{prefix}.recompute_granularity=full (got {_fmt(gran)})"
            )
        bad = set(meg.recompute_modules) - _RECOMPUTE_MODULES
        if gran == "selective" and bad:
            self.error(
                f"{prefix}.recompute_modules has unknown modules {sorted(bad)}; Megatron accepts "
                f"{sorted(_RECOMPUTE_MODULES)}"
            )

    def check_training_layout(self, world: int, facts: ModelFacts | None) -> None:
        meg = self.cfg.actor_rollout_ref.actor.megatron
        if not self.check_megatron_ranges(MEG, meg):
            return
        tp, pp = meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size
        cp, ep = meg.context_parallel_size, meg.expert_model_parallel_size
        if world % (tp * pp * cp):
            self.error(
                f"world size {world} ({WORLD}) is not divisible by {MEG}.tensor_model_parallel_size "
                f"× pipeline_model_parallel_size × context_parallel_size = {tp} × {pp} × {cp} = "
                f"{tp * pp * cp}"
            )
        if ep > 1 and world % (tp * pp * ep):
            self.error(
                f"world size {world} ({WORLD}) is not divisible by {MEG}.tensor_model_parallel_size "
                f"× pipeline_model_parallel_size × expert_model_parallel_size = {tp * pp * ep}"
            )
        if facts is None:
            return
        src = facts.source
        heads, kv, layers = facts.num_attention_heads, facts.num_key_value_heads, None
        if heads and heads % tp:
            self.error(
                f"{MEG}.tensor_model_parallel_size={tp} does not divide the model's "
                f"num_attention_heads={heads} (from {src}); use one of {_divisors(heads)}"
            )
        if kv and heads and heads % tp == 0 and kv % tp:
            self.error(
                f"{MEG}.tensor_model_parallel_size={tp} does not divide the model's "
                f"num_key_value_heads={kv} (query groups, from {src}): Megatron cannot replicate "
                f"KV heads across TP ranks (vLLM can, so the rollout TP may exceed {kv}); use a "
                f"training TP in {_divisors(kv)} and add pipeline parallelism instead"
            )
        layers = facts.num_hidden_layers
        vpp = meg.virtual_pipeline_model_parallel_size or 1
        if layers and layers % (pp * vpp):
            vpp_key = " × virtual_pipeline_model_parallel_size" if vpp > 1 else ""
            self.error(
                f"the model's num_hidden_layers={layers} (from {src}) is not divisible by "
                f"{MEG}.pipeline_model_parallel_size{vpp_key} = {pp * vpp}"
            )
        if ep > 1 and facts.num_experts is not None:
            if facts.num_experts == 0:
                self.error(
                    f"{MEG}.expert_model_parallel_size={ep} but the model is dense (from {src})"
                )
            elif facts.num_experts % ep:
                self.error(
                    f"{MEG}.expert_model_parallel_size={ep} does not divide the model's "
                    f"{facts.num_experts} experts (from {src})"
                )
        limit = facts.max_position_embeddings
        seq = self.cfg.data.max_prompt_length + self.cfg.data.max_response_length
        if limit and seq > limit:
            self.warn(
                f"data.max_prompt_length + data.max_response_length = {seq} exceeds the model's "
                f"max_position_embeddings={limit} (from {src})"
            )

    def check_rollout_layout(self, world: int, facts: ModelFacts | None) -> None:
        rtp = self.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        if not self.positive(f"{ROLL}.tensor_model_parallel_size", rtp):
            return
        if world % rtp:
            self.error(
                f"world size {world} ({WORLD}) is not divisible by "
                f"{ROLL}.tensor_model_parallel_size={rtp}"
            )
        if facts is None:
            return
        heads, kv = facts.num_attention_heads, facts.num_key_value_heads
        if heads and heads % rtp:
            self.error(
                f"{ROLL}.tensor_model_parallel_size={rtp} does not divide the model's "
                f"num_attention_heads={heads} (from {facts.source}); vLLM needs it to"
            )
        elif kv and kv % rtp and rtp % kv:
            self.error(
                f"{ROLL}.tensor_model_parallel_size={rtp} and the model's num_key_value_heads="
                f"{kv} (from {facts.source}): vLLM needs one to divide the other"
            )

    def check_shared_layouts(self) -> None:
        actor = self.cfg.actor_rollout_ref.actor.megatron
        roles = []
        if critic_enabled(self.cfg):
            roles.append(("critic.megatron", self.cfg.critic.megatron))
        if ref_used(self.cfg):
            roles.append((f"{REF}.megatron", self.cfg.actor_rollout_ref.ref.megatron))
        for prefix, meg in roles:
            diffs = [
                f"{prefix}.{k}={_fmt(getattr(meg, k))} vs {MEG}.{k}={_fmt(getattr(actor, k))}"
                for k in PARALLEL_KEYS
                if getattr(meg, k) != getattr(actor, k)
            ]
            if diffs:
                self.error(
                    f"{'; '.join(diffs)}: Megatron-Core 0.16 keeps one process-wide parallel "
                    f"state, so {prefix.rsplit('.', 1)[0]} must use the actor's parallel layout "
                    "until that is lifted (remove these keys to inherit the actor's)"
                )
            self.check_recompute(prefix, meg)

    # -- batches --------------------------------------------------------------------------

    def check_batches(self, world: int) -> None:
        c = self.cfg
        a, r = c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout
        lay = layout(c, world)
        tb, mb, n = c.data.train_batch_size, a.ppo_mini_batch_size, r.n
        if min(tb, mb, n) <= 0:
            return  # reported by check_ranges
        if tb % mb:
            self.error(
                f"data.train_batch_size={tb} is not divisible by {ACTOR}.ppo_mini_batch_size={mb}"
                " (both count prompts; each mini-batch holds ppo_mini_batch_size × rollout.n "
                "responses)"
            )
        if lay.rollout_data_parallel_size and tb % lay.rollout_data_parallel_size:
            self.error(
                f"data.train_batch_size={tb} prompts do not split evenly over "
                f"{lay.rollout_data_parallel_size} vLLM engines (world {world} / "
                f"{ROLL}.tensor_model_parallel_size={r.tensor_model_parallel_size})"
            )
        if a.ppo_micro_batch_size_per_gpu is None:
            self.error(f"{ACTOR}.ppo_micro_batch_size_per_gpu must be set (responses per pass)")
        dp = lay.data_parallel_size
        if not dp:
            return  # the layout error is already reported
        pp = c.actor_rollout_ref.actor.megatron.pipeline_model_parallel_size
        interleaved = c.actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size
        self.check_minibatch(ACTOR, mb, a.ppo_micro_batch_size_per_gpu, n, dp, pp, interleaved)
        cr = c.critic
        if critic_enabled(c) and self.positive(
            "critic.ppo_mini_batch_size", cr.ppo_mini_batch_size
        ):
            if tb % cr.ppo_mini_batch_size:
                self.error(
                    f"data.train_batch_size={tb} is not divisible by "
                    f"critic.ppo_mini_batch_size={cr.ppo_mini_batch_size}"
                )
            micro = cr.ppo_micro_batch_size_per_gpu
            if micro is None and a.ppo_micro_batch_size_per_gpu is not None:
                self.error("critic.ppo_micro_batch_size_per_gpu must be set")
            self.check_minibatch("critic", cr.ppo_mini_batch_size, micro, n, dp, pp, interleaved)
        per_rank = tb * n // dp if (tb * n) % dp == 0 else None
        log_prob_keys = [
            (f"{ROLL}.log_prob_micro_batch_size_per_gpu", r.log_prob_micro_batch_size_per_gpu)
        ]
        ref_micro = c.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
        if ref_used(c) and ref_micro != r.log_prob_micro_batch_size_per_gpu:
            log_prob_keys.append((f"{REF}.log_prob_micro_batch_size_per_gpu", ref_micro))
        for key, micro in log_prob_keys:
            if micro is None:
                if a.ppo_micro_batch_size_per_gpu is not None:
                    self.error(f"{key} must be set")
                continue
            if not self.positive(key, micro) or per_rank is None:
                continue
            if per_rank % micro:
                self.error(
                    f"{key}={micro} does not divide the {per_rank} responses each training rank "
                    f"holds (data.train_batch_size × {ROLL}.n / data-parallel size = {tb} × {n} / "
                    f"{dp})"
                )
            elif interleaved and (per_rank // micro) % pp:
                self.error(
                    f"{key}={micro} gives {per_rank // micro} micro-batches per rank, not a "
                    f"multiple of {MEG}.pipeline_model_parallel_size={pp} as the interleaved "
                    "(virtual pipeline) schedule requires"
                )

    def check_minibatch(
        self, role: str, mini: int, micro: int | None, n: int, dp: int, pp: int, vpp: int | None
    ) -> None:
        if micro is None or not self.positive(f"{role}.ppo_micro_batch_size_per_gpu", micro):
            return
        responses = mini * n
        if responses % (micro * dp):
            self.error(
                f"{role}.ppo_mini_batch_size × {ROLL}.n = {mini} × {n} = {responses} responses per "
                f"mini-batch is not divisible by {role}.ppo_micro_batch_size_per_gpu × data-parallel "
                f"size = {micro} × {dp} = {micro * dp} (data-parallel size = world / (TP × PP × CP))"
            )
            return
        micro_batches = responses // (micro * dp)
        if vpp and micro_batches % pp:
            self.error(
                f"{role}: {micro_batches} micro-batches per mini-batch and rank is not a multiple "
                f"of {MEG}.pipeline_model_parallel_size={pp}, as the interleaved (virtual "
                "pipeline) schedule requires; change ppo_mini_batch_size or "
                "ppo_micro_batch_size_per_gpu"
            )
        elif pp > 1 and micro_batches < pp:
            self.warn(
                f"{role}: {micro_batches} micro-batches per mini-batch and rank for "
                f"{pp} pipeline stages leave most stages idle; lower "
                f"{role}.ppo_micro_batch_size_per_gpu"
            )

    # -- sampling, algorithm, rewards, trainer -------------------------------------------

    def check_sampling(self) -> None:
        r = self.cfg.actor_rollout_ref.rollout
        if r.temperature <= 0:
            self.error(
                f"{ROLL}.temperature={r.temperature} must be > 0 for training rollouts "
                "(log-probs are computed from logits / temperature)"
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
        if r.logprob_mode == "importance_sampling":
            if r.is_threshold <= 0:
                self.error(f"{ROLL}.is_threshold must be > 0, got {r.is_threshold}")
            elif r.is_threshold < 1:
                self.warn(
                    f"{ROLL}.is_threshold={r.is_threshold} < 1 caps even on-policy weights below 1"
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
        if est in GROUP_ESTIMATORS and r.n < 2:
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
        if a.loss_scale_factor is not None and a.loss_agg_mode != "seq-mean-token-sum-norm":
            self.warn(
                f"{ACTOR}.loss_scale_factor is only used by loss_agg_mode=seq-mean-token-sum-norm "
                f"(got {a.loss_agg_mode})"
            )

    def check_rewards(self) -> None:
        rm, fn = self.cfg.reward_model, self.cfg.custom_reward_function
        if rm.enable and not rm.path:
            self.error("reward_model.enable=true needs reward_model.path")
        if fn.path is not None and not fn.name:
            self.error(
                "custom_reward_function.name must name the function in custom_reward_function.path"
            )
        if fn.path and fn.path.endswith(".py") and not Path(fn.path).expanduser().is_file():
            self.problem(f"custom_reward_function.path={fn.path!r} does not exist")

    def check_trainer(self) -> None:
        t = self.cfg.trainer
        for key, value in [("trainer.save_freq", t.save_freq), ("trainer.test_freq", t.test_freq)]:
            if value == 0 or value < -1:
                self.error(f"{key} must be -1 (never) or a positive step count, got {value}")
        if t.resume_mode == "resume_path" and not t.resume_from_path:
            self.error("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        unknown = [name for name in t.logger if name not in LOGGERS]
        if unknown:
            self.error(
                f"trainer.logger has {unknown}; megarl logs to {' and '.join(LOGGERS)} "
                "(MLflow replaces wandb/tensorboard)"
            )
        if t.device == "cpu" and t.dtype == "bf16":
            self.warn("trainer.dtype=bf16 on trainer.device=cpu is slow; CPU configs use fp32")

    def check_model(self) -> ModelFacts | None:
        c = self.cfg
        if not c.actor_rollout_ref.model.path:
            self.error(f"{ARR}.model.path is required (a local HF model directory or a hub id)")
            return None
        facts, errors, warnings = resolve_model_facts(
            c.actor_rollout_ref.model, f"{ARR}.model", self.check_paths
        )
        self.errors += errors
        self.warnings += warnings
        critic = c.critic.model
        if critic_enabled(c) and critic.path and critic.path != c.actor_rollout_ref.model.path:
            critic_facts, errors, warnings = resolve_model_facts(
                critic, "critic.model", self.check_paths
            )
            self.errors += errors
            self.warnings += warnings
            if critic_facts:
                self.check_critic_shape(critic_facts)
        return facts

    def check_critic_shape(self, facts: ModelFacts) -> None:
        meg = self.cfg.critic.megatron
        tp, pp = meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size
        for name in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(facts, name)
            if value and tp > 0 and value % tp:
                self.error(
                    f"critic.megatron.tensor_model_parallel_size={tp} does not divide the critic "
                    f"model's {name}={value} (from {facts.source})"
                )
        layers = facts.num_hidden_layers
        if layers and pp > 0 and layers % pp:
            self.error(
                f"the critic model's num_hidden_layers={layers} (from {facts.source}) is not "
                f"divisible by critic.megatron.pipeline_model_parallel_size={pp}"
            )

    def check_files(self) -> None:
        data = self.cfg.data
        if not data.train_files:
            self.error("data.train_files is empty")
        if not self.check_paths:
            return
        checked = [("data.train_files", data.train_files)]
        if self.cfg.trainer.test_freq > 0 or self.cfg.trainer.val_before_train:
            checked.append(("data.val_files", data.val_files))
        for key, files in checked:
            for f in files:
                if not is_remote(f) and not Path(f).expanduser().exists():
                    self.error(f"{key}: {f!r} does not exist")

    def problem(self, message: str) -> None:
        """An error when paths are checked (``megarl train``), else a warning."""
        (self.error if self.check_paths else self.warn)(message)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
