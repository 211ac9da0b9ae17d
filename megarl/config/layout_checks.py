"""Parallel-layout and batch-size checks for :func:`~megarl.config.validate.validate`: world size,
TP/PP/CP/EP against the model (Megatron's rule, :func:`megarl.parallel.layout.layout_problems`),
rollout TP, critic/ref layouts, and the batch arithmetic of :mod:`megarl.config.batch_plan`.
"""

from __future__ import annotations

from megarl.config.batch_plan import (
    MEG,
    REF,
    ROLL,
    check_batches,
    critic_enabled,
    ref_used,
    rollout_ranks,
)
from megarl.config.keys import PARALLEL_KEYS
from megarl.config.model_source import ModelShape
from megarl.config.schema import MegarlConfig, MegatronConfig
from megarl.parallel.layout import SPLIT_NAMES, shape_layout_problems

WORLD = "trainer.nnodes × trainer.n_gpus_per_node"
_RECOMPUTE_MODULES = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe"}
_RECOMPUTE_MODULES |= {"shared_experts"}


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
        ok &= self.positive(
            f"{prefix}.expert_tensor_parallel_size", meg.expert_tensor_parallel_size, True
        )
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
        if meg.context_parallel_size > 1:
            self.check_context_parallel_packing(prefix, meg)
        self.check_attention_backends()
        return ok

    def check_attention_backends(self) -> None:
        """Transformer Engine 2.9 has no fp32 attention for packed rows or context parallelism:
        flash and fused (cuDNN) attention take only 16-bit inputs, its unfused one refuses the
        THD format and CP (``dot_product_attention/utils.py::get_attention_backend``), and the
        run would stop at its first forward ("No dot product attention backend"). ``auto``
        is TE's spec on CUDA."""
        cfg = self.cfg
        if cfg.trainer.dtype != "fp32":
            return
        arr = cfg.actor_rollout_ref
        roles = [("actor_rollout_ref.actor", arr.model, arr.actor.megatron)]
        if ref_used(cfg):
            roles.append(("actor_rollout_ref.ref", arr.model, arr.ref.megatron))
        if critic_enabled(cfg):
            roles.append(("critic", cfg.critic.model, cfg.critic.megatron))
        refused = []
        for role, model, meg in roles:
            impl = meg.transformer_impl
            if impl == "local" or (impl == "auto" and cfg.trainer.device != "cuda"):
                continue
            engine = meg.use_remove_padding
            packs = model.use_remove_padding if engine is None else engine
            if packs or meg.context_parallel_size > 1:
                refused.append((role, impl, meg.context_parallel_size))
        if not refused:
            return
        (role, impl, cp), others = refused[0], [r for r, _, _ in refused[1:]]
        why = f"context_parallel_size={cp}" if cp > 1 else "packed sequences (use_remove_padding)"
        self.error(
            f"trainer.dtype=fp32 with {role}.megatron.transformer_impl={impl} (Transformer "
            f"Engine on CUDA) and {why}: TE has no fp32 attention for them; use "
            f"trainer.dtype=bf16 or {role}.megatron.transformer_impl=local"
            + ("" if cp > 1 else f", or {role}.megatron.use_remove_padding=false")
            + (f" (the same for {', '.join(others)})" if others else "")
        )

    def check_context_parallel_packing(self, prefix: str, meg: MegatronConfig) -> None:
        """Context parallelism splits packed rows: every model at that layout must pack."""
        arr = self.cfg.actor_rollout_ref
        cp = f"{prefix}.context_parallel_size={meg.context_parallel_size}"
        sections = [("actor_rollout_ref.actor", "actor_rollout_ref.model", arr.model, arr.actor.megatron),
                    ("actor_rollout_ref.ref", "actor_rollout_ref.model", arr.model, arr.ref.megatron),
                    ("critic", "critic.model", self.cfg.critic.model, self.cfg.critic.megatron)]  # fmt: skip
        problems: dict[str, None] = {}  # the reference follows the actor's model section
        for role, model_key, model, engine in sections:
            if engine.use_remove_padding is False:
                problems[f"{role}.megatron.use_remove_padding must be true (or unset)"] = None
            elif engine.use_remove_padding is None and not model.use_remove_padding:
                problems[f"{model_key}.use_remove_padding must be true"] = None
        for problem in problems:
            self.error(f"{cp} splits packed sequences: {problem}")

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
        te_only = sorted({"layernorm", "moe_act"} & set(meg.recompute_modules))
        impl = meg.transformer_impl
        local = impl == "local" or (impl == "auto" and self.cfg.trainer.device == "cpu")
        if gran == "selective" and te_only and local:
            self.error(
                f"{prefix}.recompute_modules: {', '.join(te_only)} recompute needs Transformer "
                "Engine (Megatron's CheckpointWithoutOutput); the local layer spec recomputes "
                "core_attn, mlp, moe and shared_experts"
            )

    def check_model_rule(self, prefix: str, meg: MegatronConfig, shape: ModelShape) -> None:
        """Megatron's rule for this model at this layout, naming ``prefix``'s keys."""
        vpp = meg.virtual_pipeline_model_parallel_size
        names = {
            "tp": f"{prefix}.tensor_model_parallel_size={meg.tensor_model_parallel_size}",
            "pp": f"{prefix}.pipeline_model_parallel_size={meg.pipeline_model_parallel_size}",
            "vpp": f"virtual_pipeline_model_parallel_size={vpp}",
            "ep": f"{prefix}.expert_model_parallel_size={meg.expert_model_parallel_size}",
            "etp": f"{prefix}.expert_tensor_parallel_size={meg.parallel_layout().etp}",
        }
        names |= {key: f"{prefix}.override_transformer_config.{name}" for key, name in SPLIT_NAMES}
        dims = shape.dims
        for problem in shape_layout_problems(meg.parallel_layout(), dims):
            self.error(f"{problem.describe(**names)} (model shape from {shape.source})")

    def check_training_layout(self, world: int, shape: ModelShape | None) -> None:
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
        etp = meg.parallel_layout().etp
        if (ep > 1 or meg.expert_tensor_parallel_size is not None) and world % (etp * pp * ep):
            self.error(
                f"world size {world} ({WORLD}) is not divisible by {MEG}.expert_tensor_parallel_size "
                f"(null: TP) × pipeline_model_parallel_size × expert_model_parallel_size = "
                f"{etp} × {pp} × {ep} = {etp * pp * ep}"
            )
        if shape is None:
            return
        self.check_model_rule(MEG, meg, shape)  # EP/ETP against the experts too
        src = shape.source
        limit = shape.get("max_position_embeddings")
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

    def check_rollout_layout(self, world: int, shape: ModelShape | None) -> None:
        rtp = self.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        if not self.positive(f"{ROLL}.tensor_model_parallel_size", rtp):
            return
        if rollout_ranks(self.cfg):
            pass  # vLLM on ranks of its own (megarl.config.async_checks)
        elif world % rtp:
            self.error(
                f"world size {world} ({WORLD}) is not divisible by "
                f"{ROLL}.tensor_model_parallel_size={rtp}"
            )
        self.warn_if_tp_crosses_nodes(f"{ROLL}.tensor_model_parallel_size", rtp)
        if shape is None:
            return
        head_dim, src = shape.get("head_dim"), shape.source
        if self.cfg.trainer.device == "cpu" and head_dim and head_dim < 32:
            self.warn(
                f"the model's head_dim={head_dim} (from {src}): vLLM's CPU "
                "attention rejects head_dim 16 (32 and 64 work)"
            )
        heads, kv = shape.get("num_attention_heads"), shape.get("num_query_groups")
        if heads and heads % rtp:
            self.error(
                f"{ROLL}.tensor_model_parallel_size={rtp} does not divide the model's "
                f"num_attention_heads={heads} (from {src}); vLLM needs it to"
            )
        elif kv and kv % rtp and rtp % kv:
            self.error(
                f"{ROLL}.tensor_model_parallel_size={rtp} and the model's num_key_value_heads="
                f"{kv} (from {src}): vLLM needs one to divide the other"
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
        _, errors, warnings = check_batches(self.cfg, world)
        self.errors += errors
        self.warnings += warnings

    # -- sampling, algorithm, rewards, trainer -------------------------------------------


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def fmt_value(value: object) -> str:
    """A value as YAML spells it (null, true, 0.2)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
