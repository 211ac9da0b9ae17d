"""How the schema's keys relate: which follow others when unset (``FOLLOWS``), which parallel
sizes critic and ref share with the actor, and each field's one-line docstring.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import textwrap
from functools import cache
from itertools import pairwise
from typing import Any, get_type_hints

FOLLOWS: tuple[tuple[str, str], ...] = (
    ("actor_rollout_ref.actor.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio"),
    ("actor_rollout_ref.actor.clip_ratio_high", "actor_rollout_ref.actor.clip_ratio"),
    ("actor_rollout_ref.rollout.prompt_length", "data.max_prompt_length"),
    ("actor_rollout_ref.rollout.response_length", "data.max_response_length"),
    (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    ),
    (
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    ),
    ("critic.model.path", "actor_rollout_ref.model.path"),
    ("critic.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    (
        "critic.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    ),
    ("critic.ppo_epochs", "actor_rollout_ref.actor.ppo_epochs"),
    (
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.actor.use_dynamic_bsz",
    ),
    (
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    ),
    (
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    ),
    (
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    ),
    ("critic.use_dynamic_bsz", "actor_rollout_ref.actor.use_dynamic_bsz"),
    ("critic.forward_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu"),
    ("critic.loss_agg_mode", "actor_rollout_ref.actor.loss_agg_mode"),
)
"""(key, source): a key left unset (None) takes its source's value, in this order, when the
config is built (:func:`resolve_follows`; verl expresses these as ${...} interpolations)."""

PARALLEL_KEYS: tuple[str, ...] = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)
"""Megatron layout keys that critic and ref must share with the actor (one parallel state)."""

SHARED_MEGATRON_KEYS = (*PARALLEL_KEYS, "sequence_parallel", "transformer_impl")
"""``megatron`` keys of critic and ref that follow the actor's."""
FOLLOWS += tuple(
    (f"{role}.megatron.{key}", f"actor_rollout_ref.actor.megatron.{key}")
    for role in ("critic", "actor_rollout_ref.ref")
    for key in SHARED_MEGATRON_KEYS
) + (
    (
        "actor_rollout_ref.ref.megatron.param_offload",
        "actor_rollout_ref.actor.megatron.param_offload",
    ),
)


def resolve_follows(cfg: Any) -> None:
    """Give every unset (None) key of ``FOLLOWS`` its source's value, in place.

    Part of :func:`megarl.config.loader.resolve_config`, which every built config goes through;
    idempotent.
    """
    for key, source in FOLLOWS:
        *path, leaf = key.split(".")
        owner = cfg
        for part in path:
            owner = getattr(owner, part)
        if getattr(owner, leaf) is None:
            value = cfg
            for part in source.split("."):
                value = getattr(value, part)
            setattr(owner, leaf, copy.deepcopy(value))


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of dataclass ``cls`` to its docstring (the string literal after it)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


def iter_fields(cls: type, prefix: str = ""):
    """Yield ``(dotted_key, field, owner_class)`` for every leaf field below dataclass ``cls``."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, key + ".")
        else:
            yield key, f, cls
