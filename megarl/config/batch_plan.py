"""Batch arithmetic in verl's units, as one object: :class:`BatchPlan`.

``data.train_batch_size`` and ``*.ppo_mini_batch_size`` count *prompts* (each brings
``rollout.n`` responses); ``*_micro_batch_size_per_gpu`` counts *responses* on one data-parallel
rank. A step holds ``train_batch_size × n`` responses; an update pass splits them into
mini-batches (one optimizer step each), each rank runs ``1/DP`` of one as micro-batches; the
log-prob passes cover the whole step at once. With ``use_dynamic_bsz`` micro-batches are packed
to a token budget at run time, so their count is unknown here (``micro_batches_per_rank`` None).
The trainer uses :meth:`BatchPlan.from_config`; validation reports the same problems through
:func:`check_batches`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config.async_schedule import (  # rollout_ranks: re-exported
    extra_batches,
    partial_rollouts,
    rollout_ranks,
    sync_interval,
)
from megarl.config.errors import ConfigError
from megarl.config.schema import MegarlConfig
from megarl.config.teachers import teachers

ARR = "actor_rollout_ref"
ACTOR = f"{ARR}.actor"
ROLL = f"{ARR}.rollout"
REF = f"{ARR}.ref"
MEG = f"{ACTOR}.megatron"


def critic_enabled(cfg: MegarlConfig) -> bool:
    """critic.enable, or (when null) whether the estimator is gae."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae"


def ref_used(cfg: MegarlConfig) -> bool:
    """The reference policy is needed for a KL loss or a KL penalty in the reward."""
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def teacher_engine(cfg: MegarlConfig) -> str | None:
    """The distillation teachers' ``inference.name`` (one for all; None: distillation off)."""
    found = teachers(cfg)
    return found[0].engine if found else None


def teacher_used(cfg: MegarlConfig) -> bool:
    """On-policy distillation's teacher is a frozen Megatron model on the training ranks
    (``inference.name=megatron``), its pass batched as the reference's (``ref.log_prob_*``)."""
    return teacher_engine(cfg) == "megatron"


def teacher_inference(cfg: MegarlConfig) -> dict:
    """The first teacher's ``inference`` (a copy; {} without one)."""
    found = teachers(cfg)
    return dict(found[0].inference) if found else {}


def as_int(value, default: int | None = None) -> int | None:
    """An int given as such or as text (``${...}`` in a free-form section resolve to text);
    ``default`` for None."""
    if value is None:
        return default
    return int(str(value).strip())


def teacher_tp(cfg: MegarlConfig) -> int:
    """The first vLLM teacher's tensor-parallel size (``inference.tensor_model_parallel_size``)."""
    found = teachers(cfg)
    return found[0].tp if found else 1


def teacher_blocks(cfg: MegarlConfig) -> tuple[int, ...]:
    """Each vLLM teacher's share of the teacher-only processes, in pool order (empty when
    no vLLM teacher has a pool)."""
    if teacher_engine(cfg) != "vllm":
        return ()
    return tuple(t.ranks for t in teachers(cfg))


def teacher_ranks(cfg: MegarlConfig) -> int:
    """Teacher-only processes after the rollout-only ones: the distillation pool,
    ``distillation.nnodes × n_gpus_per_node``, when vLLM serves the teachers (0 otherwise)."""
    if teacher_engine(cfg) != "vllm":
        return 0
    return max(cfg.distillation.nnodes, 0) * max(cfg.distillation.n_gpus_per_node, 0)


def world_size(cfg: MegarlConfig) -> int:
    """Training processes of the run: trainer.nnodes × trainer.n_gpus_per_node."""
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def steps_ahead(cfg: MegarlConfig) -> int:
    """How many steps' batches the trainer asks ahead of the one it trains (the staleness
    bound, in updates): ``async_training.staleness_threshold`` rounded up, with vLLM on ranks
    of its own; 0 otherwise."""
    if not rollout_ranks(cfg):
        return 0
    return math.ceil(max(cfg.async_training.staleness_threshold, 0.0))


def stages_weight_updates(cfg: MegarlConfig) -> bool:
    """Whether the rollout ranks receive weight updates while they generate, into a staging
    copy in host memory (beyond one step off); otherwise each update goes straight into vLLM
    between two requests, over NCCL where the GPUs are the ranks' own. A batch asked more than
    one weight version ahead needs the slot (``async_training`` asking past the next window);
    partial rollouts never do: the rollout ranks load each update when it comes, interrupting
    their requests (:mod:`megarl.config.async_schedule`)."""
    return not partial_rollouts(cfg) and extra_batches(cfg) > sync_interval(cfg)


@dataclass(frozen=True)
class PassBatches:
    """How one pass over a step's responses is split (an update, or a log-prob pass)."""

    name: str
    """What the pass computes, e.g. ``actor update`` or ``old log-probs``."""
    micro_key: str
    """The config key of its micro-batch size (or of its token budget with dynamic batching)."""
    batches_per_step: int
    """Mini-batches (optimizer steps) per training step and epoch; 1 for a log-prob pass."""
    responses_per_batch: int
    """Responses in one mini-batch over all DP ranks (the whole step for a log-prob pass)."""
    responses_per_rank: int
    """Responses of one mini-batch on one data-parallel rank."""
    micro_batch_size: int | None
    """Responses per micro-batch on one rank; None with dynamic batching."""
    micro_batches_per_rank: int | None
    """Micro-batches per rank and mini-batch; None: decided by a token budget at run time."""
    max_token_len_per_gpu: int | None = None
    """Token budget of one micro-batch with dynamic batching (None without)."""

    @property
    def dynamic(self) -> bool:
        """True when the micro-batch count is decided at run time by the token budget."""
        return self.micro_batches_per_rank is None


@dataclass(frozen=True)
class BatchPlan:
    """Sizes of one training step in verl's units, for every pass the trainer runs."""

    prompts_per_step: int
    """data.train_batch_size."""
    responses_per_prompt: int
    """actor_rollout_ref.rollout.n."""
    data_parallel_size: int
    """Training DP: world / (TP × PP × CP) of the actor."""
    rollout_data_parallel_size: int
    """vLLM engines: world / rollout TP (each generates for train_batch_size / this prompts), or
    with vLLM on ranks of its own, those ranks / rollout TP."""
    actor: PassBatches
    """The actor's PPO update (per epoch)."""
    old_log_prob: PassBatches
    """The actor's old-log-prob pass (rollout.log_prob_*)."""
    critic: PassBatches | None = None
    """The critic's update (None without a critic)."""
    values: PassBatches | None = None
    """The critic's value pass (critic.forward_max_token_len_per_gpu with dynamic batching)."""
    ref_log_prob: PassBatches | None = None
    """The reference policy's log-prob pass (None when no KL is used)."""

    @property
    def responses_per_step(self) -> int:
        """train_batch_size × rollout.n."""
        return self.prompts_per_step * self.responses_per_prompt

    @property
    def mini_batches_per_step(self) -> int:
        """Actor optimizer steps per training step and epoch."""
        return self.actor.batches_per_step

    @property
    def responses_per_mini_batch(self) -> int:
        """ppo_mini_batch_size × rollout.n."""
        return self.actor.responses_per_batch

    @property
    def responses_per_rank_per_mini_batch(self) -> int:
        """Responses of one actor mini-batch on one DP rank."""
        return self.actor.responses_per_rank

    @property
    def micro_batches_per_mini_batch(self) -> int | None:
        """Actor micro-batches per DP rank and mini-batch (None: by token budget at run time)."""
        return self.actor.micro_batches_per_rank

    @property
    def prompts_per_rollout_rank(self) -> int:
        """Prompts each vLLM engine generates for per step."""
        return self.prompts_per_step // self.rollout_data_parallel_size

    @classmethod
    def from_config(cls, cfg: MegarlConfig, world: int | None = None) -> BatchPlan:
        """The plan of ``cfg`` at ``world`` ranks (default nnodes × n_gpus_per_node).

        Raises ``ConfigError`` naming the keys whose values do not divide as they must.
        """
        plan, errors, _ = check_batches(cfg, world or world_size(cfg))
        if errors or plan is None:
            raise ConfigError(errors or ["the parallel layout leaves no data-parallel size"])
        return plan


def check_batches(cfg: MegarlConfig, world: int) -> tuple[BatchPlan | None, list[str], list[str]]:
    """(plan or None, errors, warnings) of ``cfg`` at ``world`` ranks; each message names keys.

    Layout problems (a world not divisible by TP × PP × CP or by rollout TP) are left to the
    layout checks: the plan is then None without an error from here.
    """
    b = _Builder(cfg, world)
    plan = b.build()
    return (None if b.errors else plan), b.errors, b.warnings


class _Builder:
    def __init__(self, cfg: MegarlConfig, world: int):
        self.cfg = cfg
        self.world = world
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.meg = cfg.actor_rollout_ref.actor.megatron

    def build(self) -> BatchPlan | None:
        c = self.cfg
        a, r = c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout
        tb, mb, n = c.data.train_batch_size, a.ppo_mini_batch_size, r.n
        if min(tb, mb, n) <= 0:
            return None  # reported by the range checks
        layout = self.meg.parallel_layout()
        mp = layout.model_parallel_size()
        rtp = r.tensor_model_parallel_size
        own = rollout_ranks(c)  # vLLM on ranks of its own: its engines, not the training world's
        if mp < 1 or rtp < 1 or self.world % mp or (own or self.world) % rtp:
            return None  # reported by the layout checks
        dp, rollout_dp = self.world // mp, (own or self.world) // rtp
        # The engines on ranks of their own take the prompts as they come (uneven shares are
        # fine); colocated engines each generate for an equal share of the batch.
        if not own and tb % rollout_dp:
            self.errors.append(
                f"data.train_batch_size={tb} prompts do not split evenly over {rollout_dp} vLLM "
                f"engines (world {self.world} / {ROLL}.tensor_model_parallel_size={rtp})"
            )
        actor = self.update(ACTOR, "actor update", mb, a.ppo_micro_batch_size_per_gpu,
                            a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu, dp)  # fmt: skip
        old = self.log_prob(
            "old log-probs",
            ROLL,
            r.log_prob_micro_batch_size_per_gpu,
            r.log_prob_use_dynamic_bsz,
            r.log_prob_max_token_len_per_gpu,
            dp,
        )
        critic = values = ref = None
        if critic_enabled(c):
            cr = c.critic
            critic = self.update("critic", "critic update", cr.ppo_mini_batch_size,
                                 cr.ppo_micro_batch_size_per_gpu, cr.use_dynamic_bsz,
                                 cr.ppo_max_token_len_per_gpu, dp)  # fmt: skip
            values = self.log_prob(
                "values",
                "critic",
                cr.ppo_micro_batch_size_per_gpu,
                cr.use_dynamic_bsz,
                cr.forward_max_token_len_per_gpu,
                dp,
                micro_name="ppo_micro_batch_size_per_gpu",
                budget_name="forward_max_token_len_per_gpu",
                dynamic_name="use_dynamic_bsz",
            )
        if ref_used(c) or teacher_used(c):  # the teacher's pass is batched as the reference's
            rf = c.actor_rollout_ref.ref
            ref = self.log_prob(
                "reference log-probs",
                REF,
                rf.log_prob_micro_batch_size_per_gpu,
                rf.log_prob_use_dynamic_bsz,
                rf.log_prob_max_token_len_per_gpu,
                dp,
            )
        if actor is None or old is None:
            return None
        return BatchPlan(tb, n, dp, rollout_dp, actor, old, critic, values, ref)

    # -- one pass ---------------------------------------------------------------------------

    def update(
        self,
        role: str,
        name: str,
        mini: int,
        micro: int | None,
        dynamic: bool,
        budget: int,
        dp: int,
    ) -> PassBatches | None:
        tb, n = self.cfg.data.train_batch_size, self.cfg.actor_rollout_ref.rollout.n
        if mini <= 0:
            self.errors.append(f"{role}.ppo_mini_batch_size must be a positive number, got {mini}")
            return None
        ok = True
        if tb % mini:
            self.errors.append(
                f"data.train_batch_size={tb} is not divisible by {role}.ppo_mini_batch_size="
                f"{mini} (both count prompts; each mini-batch holds ppo_mini_batch_size × "
                "rollout.n responses)"
            )
            ok = False
        responses = mini * n
        if dynamic:
            return self.dynamic_pass(name, role, "ppo_max_token_len_per_gpu", budget, dp,
                                     responses, tb // mini if ok else 0,
                                     f"{role}.ppo_mini_batch_size × {ROLL}.n = {mini} × {n}")  # fmt: skip
        key = f"{role}.ppo_micro_batch_size_per_gpu"
        if micro is None:
            self.errors.append(
                f"{key} must be set (responses per pass; or set {role}.use_dynamic_bsz=true)"
            )
            return None
        if micro <= 0:
            self.errors.append(f"{key} must be a positive number, got {micro}")
            return None
        if responses % (micro * dp):
            self.errors.append(
                f"{role}.ppo_mini_batch_size × {ROLL}.n = {mini} × {n} = {responses} responses "
                f"per mini-batch is not divisible by {key} × data-parallel size = {micro} × {dp} "
                f"= {micro * dp} (data-parallel size = world / (TP × PP × CP))"
            )
            return None
        count = responses // (micro * dp)
        self.pipeline_fit(role, key, count, warn=True)
        if not ok:
            return None
        return PassBatches(name, key, tb // mini, responses, responses // dp, micro, count)

    def log_prob(
        self,
        name: str,
        prefix: str,
        micro: int | None,
        dynamic: bool,
        budget: int,
        dp: int,
        micro_name: str = "log_prob_micro_batch_size_per_gpu",
        budget_name: str = "log_prob_max_token_len_per_gpu",
        dynamic_name: str = "log_prob_use_dynamic_bsz",
    ) -> PassBatches | None:
        tb, n = self.cfg.data.train_batch_size, self.cfg.actor_rollout_ref.rollout.n
        responses = tb * n
        if dynamic:
            return self.dynamic_pass(name, prefix, budget_name, budget, dp, responses, 1,
                                     f"data.train_batch_size × {ROLL}.n = {tb} × {n}")  # fmt: skip
        key = f"{prefix}.{micro_name}"
        if micro is None:
            self.errors.append(
                f"{key} must be set (or set {prefix}.{dynamic_name}=true for a token budget)"
            )
            return None
        if micro <= 0:
            self.errors.append(f"{key} must be a positive number, got {micro}")
            return None
        if responses % dp:
            self.errors.append(
                f"data.train_batch_size × {ROLL}.n = {tb} × {n} = {responses} responses do not "
                f"split evenly over data-parallel size {dp}"
            )
            return None
        per_rank = responses // dp
        if per_rank % micro:
            self.errors.append(
                f"{key}={micro} does not divide the {per_rank} responses each training rank "
                f"holds (data.train_batch_size × {ROLL}.n / data-parallel size = {tb} × {n} / "
                f"{dp})"
            )
            return None
        count = per_rank // micro
        self.pipeline_fit(prefix, f"{key}={micro}", count, warn=False)
        return PassBatches(name, key, 1, responses, per_rank, micro, count)

    def dynamic_pass(
        self,
        name: str,
        prefix: str,
        budget_name: str,
        budget: int,
        dp: int,
        responses: int,
        batches: int,
        what: str,
    ) -> PassBatches | None:
        key = f"{prefix}.{budget_name}"
        d = self.cfg.data
        longest = d.max_prompt_length + d.max_response_length
        # Per GPU: a micro-batch holds budget × CP tokens, each sequence split over the CP ranks
        # (verl's Megatron workers scale the budget so).
        cp = self.cfg.actor_rollout_ref.actor.megatron.context_parallel_size
        if budget * cp < longest:
            times_cp = f" × context_parallel_size {cp}" if cp > 1 else ""
            self.errors.append(
                f"{key}={budget}{times_cp} is below the longest sequence, "
                f"data.max_prompt_length + data.max_response_length = {longest}, which could "
                "then fit no micro-batch"
            )
            return None
        if responses % dp:
            self.errors.append(
                f"{what} = {responses} responses do not split evenly over data-parallel size {dp}"
            )
            return None
        if not batches:
            return None
        return PassBatches(name, key, batches, responses, responses // dp, None, None, budget)

    def pipeline_fit(self, role: str, key: str, count: int, *, warn: bool) -> None:
        """The interleaved schedule needs a multiple of PP micro-batches; fewer than PP idle."""
        pp = self.meg.pipeline_model_parallel_size
        if self.meg.virtual_pipeline_model_parallel_size and count % pp:
            where = f"{role}: {count}" if warn else f"{key} gives {count}"
            self.errors.append(
                f"{where} micro-batches per mini-batch and rank is not a multiple of "
                f"{MEG}.pipeline_model_parallel_size={pp}, as the interleaved (virtual "
                "pipeline) schedule requires"
                + ("; change ppo_mini_batch_size or ppo_micro_batch_size_per_gpu" if warn else "")
            )
        elif warn and pp > 1 and count < pp:
            self.warnings.append(
                f"{role}: {count} micro-batches per mini-batch and rank for {pp} pipeline stages "
                f"leave most stages idle; lower {key}"
            )
