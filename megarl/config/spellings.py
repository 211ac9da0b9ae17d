"""Keys verl spells two ways, and keys accepted only at a value another key already gives.

- verl 0.9's ``reward.*`` section and the older ``reward_model.*`` / ``custom_reward_function.*``
  keys (verl 0.9 still maps the older ones onto the new, ``migrate_legacy_reward_impl``); the
  async recipes' top-level ``rollout.*`` and ``actor_rollout_ref.rollout.*``. Either spelling is
  accepted; megarl reads the older key, so :func:`resolve_spellings` copies a key given the new
  way onto it and then mirrors the result back, and one setting given both ways with different
  values is refused in one line (verl lets the older spelling win silently).
- verl's fully-async spelling ``data.train_batch_size=0`` (the batch is
  ``ppo_mini_batch_size x async_training.require_batches``) and ``rollout.total_rollout_steps``
  (prompts in all, which sets ``trainer.total_training_steps`` when it is unset).
- ``actor_rollout_ref.rollout.dtype`` / ``seed`` (:data:`ECHOES`): megarl's rollout runs at
  ``trainer.dtype`` and ``trainer.seed``; the keys are checked against those and dropped.
"""

from __future__ import annotations

import copy
from typing import Any

from megarl.config.dtypes import DTYPE_NAMES
from megarl.config.schema import MegarlConfig
from megarl.config.transformer_overrides import MEGARL_KEYS, NO_EFFECT

ROLL = "actor_rollout_ref.rollout"
PAIRS: tuple[tuple[str, str], ...] = (
    ("reward.num_workers", "reward_model.num_workers"),
    ("reward.custom_reward_function.path", "custom_reward_function.path"),
    ("reward.custom_reward_function.name", "custom_reward_function.name"),
    ("reward.custom_reward_function.reward_kwargs", "custom_reward_function.reward_kwargs"),
    ("reward.reward_manager.name", "reward_model.reward_manager"),
    ("reward.reward_manager.source", "reward_model.reward_loop_source"),
    ("reward.reward_manager.module.path", "reward_model.reward_loop_module_path"),
    ("reward.reward_manager.module.name", "reward_model.reward_loop_class_name"),
    ("reward.reward_kwargs", "reward_model.reward_kwargs"),
    ("reward.reward_model.enable", "reward_model.enable"),
    ("reward.reward_model.model_path", "reward_model.model.path"),
    *(
        (f"reward.sandbox_fusion.{k}", f"sandbox_fusion.{k}")
        for k in ("url", "max_concurrent", "memory_limit_mb")
    ),
    ("rollout.nnodes", f"{ROLL}.nnodes"),
    ("rollout.n_gpus_per_node", f"{ROLL}.n_gpus_per_node"),
)
"""(verl 0.9's key, the key megarl reads): one setting each."""

ECHOES = (f"{ROLL}.dtype", f"{ROLL}.seed")
"""verl keys megarl takes only at ``trainer.dtype`` / ``trainer.seed`` (checked, not stored)."""


def _get(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _set(obj: Any, key: str, value: Any) -> None:
    *path, leaf = key.split(".")
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, leaf, value)


def _leaves(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d:
        return {prefix: d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _show(value: Any) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def resolve_spellings(cfg: MegarlConfig, errors: list[str]) -> None:
    """Copy every key given verl 0.9's way onto the key megarl reads, mirror the result back, and
    record a setting given both ways with different values (see the module doc). In place."""
    fresh = MegarlConfig()
    for new, old in PAIRS:
        value, given_old = _get(cfg, new), _get(cfg, old)
        default_new, default_old = _get(fresh, new), _get(fresh, old)
        if isinstance(default_new, dict):
            _resolve_dicts(cfg, new, old, default_new, errors)
            continue
        if value != default_new:
            if given_old != default_old and given_old != value:
                errors.append(
                    f"{new}={_show(value)} and {old}={_show(given_old)} are one setting (verl "
                    f"0.9's spelling and the older one) given two values; give one of them"
                )
                continue
            _set(cfg, old, copy.deepcopy(value))
        _set(cfg, new, copy.deepcopy(_get(cfg, old)))
    _resolve_async_batch(cfg, errors)
    arr = cfg.actor_rollout_ref
    if arr.nccl_timeout is None:  # the critic's alone (verl's default 600 spelled out): the run's
        arr.nccl_timeout = cfg.critic.nccl_timeout
    _resolve_transformer_overrides(cfg, errors)
    _resolve_model_config_overrides(cfg, errors)


def _resolve_transformer_overrides(cfg: MegarlConfig, errors: list[str]) -> None:
    """verl's ``megatron.override_transformer_config`` entries that are megarl's ``megatron.*``
    keys of the same names (:data:`~megarl.config.transformer_overrides.MEGARL_KEYS`: recompute,
    fusions) move there (one setting given both ways with different values is refused); the
    ``NO_EFFECT`` entries are dropped. The rest is checked by validation
    (:func:`~megarl.config.transformer_overrides.transformer_override_problems`)."""
    roles = (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.megatron),
             ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.megatron),
             ("critic", cfg.critic.megatron))  # fmt: skip
    for role, meg in roles:
        overrides = meg.override_transformer_config
        for key in NO_EFFECT:
            overrides.pop(key, None)
        fresh = type(meg)()
        for key in MEGARL_KEYS:
            if key not in overrides:
                continue
            value, mine = overrides.pop(key), getattr(meg, key)
            if mine != getattr(fresh, key) and mine != value:
                errors.append(
                    f"{role}.megatron.override_transformer_config.{key}={_show(value)} and "
                    f"{role}.megatron.{key}={_show(mine)} are one setting given two values; "
                    "give one of them"
                )
                continue
            setattr(meg, key, value)


def _resolve_model_config_overrides(cfg: MegarlConfig, errors: list[str]) -> None:
    """``model.override_config.model_config.*`` (verl's Megatron spelling, as in its fully-async
    scripts) is ``model.override_config.*``: verl reads the ``model_config`` entry instead of the
    whole dict when there is one; megarl merges it in (one field given both ways with different
    values is refused)."""
    for key, model in (("actor_rollout_ref.model", cfg.actor_rollout_ref.model),
                       ("critic.model", cfg.critic.model)):  # fmt: skip
        inner = model.override_config.get("model_config")
        if not isinstance(inner, dict):
            continue
        del model.override_config["model_config"]
        for name, value in inner.items():
            if name in model.override_config and model.override_config[name] != value:
                errors.append(
                    f"{key}.override_config.model_config.{name}={_show(value)} and "
                    f"{key}.override_config.{name}={_show(model.override_config[name])} are one "
                    "setting given two values; give one of them"
                )
                continue
            model.override_config[name] = value


def _resolve_dicts(cfg, new: str, old: str, default_new: dict, errors: list[str]) -> None:
    """Free-form sections: leaf by leaf (a leaf of the new one at its default is not given)."""
    ours, theirs = _get(cfg, new) or {}, _get(cfg, old) or {}
    defaults = _leaves(default_new)
    given_new = {k: v for k, v in _leaves(ours).items() if k not in defaults or defaults[k] != v}
    given_old = _leaves(theirs)
    clashes = [k for k, v in given_new.items() if k in given_old and given_old[k] != v]
    if clashes:
        k = clashes[0]
        errors.append(
            f"{new}.{k}={_show(given_new[k])} and {old}.{k}={_show(given_old[k])} are one setting "
            f"(verl 0.9's spelling and the older one) given two values; give one of them"
        )
        return
    merged = _merge(_merge(ours, theirs), {})
    for key, value in given_new.items():  # a given new leaf over an old default-free absence
        node = merged
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    _set(cfg, old, merged)
    _set(cfg, new, copy.deepcopy(merged))


def _resolve_async_batch(cfg: MegarlConfig, errors: list[str]) -> None:
    """``data.train_batch_size=0`` and ``rollout.total_rollout_steps`` (verl's fully async)."""
    data, a = cfg.data, cfg.async_training
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    if data.train_batch_size == 0:
        data.train_batch_size = mini * (a.require_batches or 1)
    elif a.require_batches is not None and a.require_batches * mini != data.train_batch_size:
        errors.append(
            f"async_training.require_batches={a.require_batches}: megarl's update takes "
            f"data.train_batch_size={data.train_batch_size} prompts, not require_batches x "
            f"ppo_mini_batch_size={a.require_batches * mini}; set data.train_batch_size=0 (verl's "
            f"fully-async spelling) or leave require_batches unset"
        )
    total = cfg.rollout.total_rollout_steps
    if total is not None and cfg.trainer.total_training_steps is None and data.train_batch_size:
        cfg.trainer.total_training_steps = max(total // data.train_batch_size, 1)


def check_echoes(cfg: MegarlConfig, given: dict[str, Any], errors: list[str]) -> None:
    """The :data:`ECHOES` keys given (``given``: key -> value, taken out of the raw config
    before it was built) must name ``trainer.dtype`` / ``trainer.seed``."""
    for key, value in given.items():
        if key.endswith(".dtype"):
            dtype = cfg.trainer.dtype
            name = str(value).removeprefix("torch.")
            if value is not None and DTYPE_NAMES.get(name) != DTYPE_NAMES[dtype]:
                names = [k for k, v in DTYPE_NAMES.items() if v == DTYPE_NAMES[dtype]]
                errors.append(
                    f"{key}={value}: megarl's rollout runs at trainer.dtype ({dtype}); use "
                    f"{' or '.join(names)} or leave it unset"
                )
        elif value is not None and value != cfg.trainer.seed:
            errors.append(
                f"{key}={value}: megarl's rollout is seeded with trainer.seed "
                f"({cfg.trainer.seed}); use {cfg.trainer.seed}, leave it unset, or set "
                f"trainer.seed={value}"
            )


def pop_echoes(raw: dict) -> dict[str, Any]:
    """Take the :data:`ECHOES` keys out of a raw config dict; returns key -> value given."""
    found = {}
    for key in ECHOES:
        *path, leaf = key.split(".")
        node = raw
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            found[key] = node.pop(leaf)
    return found
