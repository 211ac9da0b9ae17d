"""Checks of verl's recipe keys: the reward manager and its ``reward_kwargs`` (DAPO's overlong
buffer), DAPO's dynamic sampling (``algorithm.filter_groups``, ``data.gen_batch_size``), GDPO's
reward components, and ``hybrid_engine=false`` of the async recipes. Each problem is one line
through ``error`` (naming the key and the values that work), as validation collects them.
"""

from __future__ import annotations

from collections.abc import Callable

from megarl.config.batch_plan import ARR, rollout_ranks
from megarl.config.schema_reward import REWARD_MANAGERS

Error = Callable[[str], None]

MANAGER = "reward.reward_manager"
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
"""filter_groups metrics megarl computes itself; any other is a field of the scorer's dict."""


def check_recipe_keys(cfg, error: Error) -> None:
    """Every problem of the keys this module covers, through ``error``."""
    _check_manager(cfg, error)
    _check_overlong_buffer(cfg, error)
    _check_filter_groups(cfg, error)
    _check_gdpo(cfg, error)
    if not cfg.actor_rollout_ref.hybrid_engine and not rollout_ranks(cfg):
        error(
            f"{ARR}.hybrid_engine=false (verl's async recipes) needs the rollout's own ranks: set "
            "rollout.nnodes (or actor_rollout_ref.rollout.nnodes) > 0, or hybrid_engine=true"
        )


def _check_manager(cfg, error: Error) -> None:
    m = cfg.reward.reward_manager
    if (m.source or "register") == "register":
        name = m.name or "naive"
        if name not in REWARD_MANAGERS:
            error(
                f"{MANAGER}.name={name}: megarl's reward managers are {', '.join(REWARD_MANAGERS)}"
                f" (or {MANAGER}.source=importlib with {MANAGER}.module.path for a class of yours)"
            )
        return
    if not m.module.path:
        error(f"{MANAGER}.source=importlib needs {MANAGER}.module.path (the file of your class)")
    elif not (m.name or m.module.name):
        error(f"{MANAGER}.source=importlib needs {MANAGER}.name (your class's name, as verl)")


def overlong_settings(cfg) -> dict | None:
    """DAPO's overlong buffer ``{len, penalty_factor, log, max_resp_len}`` when the dapo
    manager has it enabled, else None."""
    if (cfg.reward.reward_manager.source or "register") != "register":
        return None
    if (cfg.reward.reward_manager.name or "naive") != "dapo":
        return None
    kwargs = cfg.reward.reward_kwargs or {}
    buffer = kwargs.get("overlong_buffer_cfg") or {}
    if not buffer.get("enable", False):
        return None
    return {
        "len": buffer.get("len", 0),
        "penalty_factor": buffer.get("penalty_factor", 0.0),
        "log": bool(buffer.get("log", False)),
        "max_resp_len": kwargs.get("max_resp_len"),
    }


def _check_overlong_buffer(cfg, error: Error) -> None:
    o = overlong_settings(cfg)
    if o is None:
        return
    key = "reward.reward_kwargs"
    if o["max_resp_len"] is None:
        error(f"{key}.overlong_buffer_cfg.enable=true needs {key}.max_resp_len (as verl asserts)")
        return
    if not o["len"] or o["len"] <= 0:
        error(
            f"{key}.overlong_buffer_cfg.len must be > 0 with the overlong buffer enabled, got "
            f"{o['len']} (to switch the penalty off: overlong_buffer_cfg.enable=false)"
        )
    elif o["max_resp_len"] < o["len"]:
        error(
            f"{key}.max_resp_len={o['max_resp_len']} must be >= overlong_buffer_cfg.len="
            f"{o['len']} (as verl asserts)"
        )
    else:  # the penalty starts past max_resp_len - len tokens: a response must be able to get there
        budget = cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length
        start = o["max_resp_len"] - o["len"]
        if budget <= start:
            error(
                f"{key}.max_resp_len={o['max_resp_len']} with overlong_buffer_cfg.len={o['len']}: "
                f"the penalty starts past {start} response tokens, and responses have at most "
                f"{budget} ({ARR}.rollout.response_length, default data.max_response_length), so "
                f"it never applies; set max_resp_len to the response length ({budget}, as verl's "
                "DAPO recipe does)"
            )


def _check_filter_groups(cfg, error: Error) -> None:
    fg, data = cfg.algorithm.filter_groups, cfg.data
    if data.gen_batch_size is not None and data.gen_batch_size < 1:
        error(
            f"data.gen_batch_size must be a positive number of prompts, got {data.gen_batch_size}"
        )
    if fg.max_inflight_gen_batches != 1:
        error(
            f"algorithm.filter_groups.max_inflight_gen_batches={fg.max_inflight_gen_batches}: "
            "megarl generates one batch at a time; use 1"
        )
    if not fg.enable:
        if data.gen_batch_size not in (None, data.train_batch_size) and not rollout_ranks(cfg):
            error(
                f"data.gen_batch_size={data.gen_batch_size} without algorithm.filter_groups.enable: "
                f"each step generates data.train_batch_size={data.train_batch_size} prompts; set "
                "gen_batch_size equal to it, leave it unset, or enable filter_groups"
            )
        return
    if not fg.metric:
        error(
            "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric ("
            f"{', '.join(FILTER_METRICS)}, or a field of your reward function's returned dict)"
        )
    if cfg.algorithm.use_kl_in_reward and fg.metric == "seq_final_reward":
        error(
            "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward: "
            "megarl applies the KL penalty after filtering; use seq_reward or acc"
        )
    if cfg.algorithm.adv_estimator == "remax":
        error(
            "algorithm.filter_groups.enable=true with algorithm.adv_estimator=remax: the greedy "
            "baseline is generated per step, not per generation batch; use grpo or rloo"
        )


def _check_gdpo(cfg, error: Error) -> None:
    alg = cfg.algorithm
    if alg.adv_estimator != "gdpo":
        if alg.gdpo_reward_keys:
            error(
                f"algorithm.gdpo_reward_keys is read by algorithm.adv_estimator=gdpo only (got "
                f"{alg.adv_estimator})"
            )
        return
    if not alg.gdpo_reward_keys:
        error(
            "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the reward "
            "components (keys of your reward function's returned dict) normalised one by one, "
            "e.g. algorithm.gdpo_reward_keys=[format_reward,accuracy_reward] (verl asserts too)"
        )
        return
    weights = alg.gdpo_reward_weights
    if weights is not None and len(weights) != len(alg.gdpo_reward_keys):
        error(
            f"algorithm.gdpo_reward_weights has {len(weights)} entries for "
            f"{len(alg.gdpo_reward_keys)} algorithm.gdpo_reward_keys; give one weight per key"
        )
