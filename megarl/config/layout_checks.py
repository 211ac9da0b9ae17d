"""Parallel-layout and batch-size checks: world size, TP/PP/CP/EP against the model, rollout TP,
critic/ref layouts, and verl's batch units (prompts per batch, responses per mini-batch).

Used by :func:`megarl.config.validate.validate`; ``layout(cfg)`` also feeds summaries.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.model_facts import ModelFacts
from megarl.config.schema import PARALLEL_KEYS, MegarlConfig, MegatronConfig

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


class LayoutChecks:
    """Collects errors and warnings; the layout and batch checks (see ``validate._Checks``)."""

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

    def positive(self, key: str, value: float | None, allow_none: bool = False) -> bool:
        if value is None and allow_none:
            return True
        if value is None or value <= 0:
            self.error(f"{key} must be a positive number, got {fmt_value(value)}")
            return False
        return True

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
                f"block) and {prefix}.recompute_num_layers (got {fmt_value(method)}, {fmt_value(layers)})"
            )
        if gran != "full" and (method is not None or layers is not None):
            self.error(
                f"{prefix}.recompute_method and recompute_num_layers apply only with "
                f"{prefix}.recompute_granularity=full (got {fmt_value(gran)})"
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
        self.warn_if_tp_crosses_nodes(f"{MEG}.tensor_model_parallel_size", tp)
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

    def warn_if_tp_crosses_nodes(self, key: str, tp: int) -> None:
        per_node = self.cfg.trainer.n_gpus_per_node
        if self.cfg.trainer.nnodes > 1 and tp > per_node:
            self.warn(
                f"{key}={tp} exceeds trainer.n_gpus_per_node={per_node}: tensor parallelism "
                "then crosses the inter-node network, which is slow; prefer PP across nodes"
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
        self.warn_if_tp_crosses_nodes(f"{ROLL}.tensor_model_parallel_size", rtp)
        if facts is None:
            return
        if self.cfg.trainer.device == "cpu" and facts.head_dim and facts.head_dim < 32:
            self.warn(
                f"the model's head_dim={facts.head_dim} (from {facts.source}): vLLM's CPU "
                "attention rejects head_dim 16 (32 and 64 work)"
            )
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
                f"{prefix}.{k}={fmt_value(getattr(meg, k))} vs {MEG}.{k}={fmt_value(getattr(actor, k))}"
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fmt_value(value: object) -> str:
    """A value as YAML spells it (null, true, 0.2)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
