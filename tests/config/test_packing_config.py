"""Packing and context parallelism in verl's vocabulary: verl's Megatron example overrides
(``use_remove_padding=True``, ``context_parallel_size=2`` on every model, dynamic batch sizes)
validate unchanged; context parallelism with packing switched off is refused in one line naming
the key; which models pack follows the keys (:func:`megarl.trainer.setup.packs`)."""

from __future__ import annotations

from megarl.config import ConfigError, load_config, validate
from megarl.trainer.setup import packs
from tests.config._bad_configs import GRPO

ARR = "actor_rollout_ref"
VERL_CP2 = [
    f"{ARR}.model.use_remove_padding=True",
    f"{ARR}.actor.megatron.tensor_model_parallel_size=1",
    f"{ARR}.actor.megatron.context_parallel_size=2",
    f"{ARR}.ref.megatron.context_parallel_size=2",
    "critic.megatron.context_parallel_size=2",
    "critic.model.use_remove_padding=True",
    f"{ARR}.actor.use_dynamic_bsz=True",
    f"{ARR}.actor.ppo_max_token_len_per_gpu=4096",
    f"{ARR}.rollout.log_prob_use_dynamic_bsz=True",
    f"{ARR}.rollout.log_prob_max_token_len_per_gpu=8192",
    f"{ARR}.actor.megatron.use_remove_padding=True",
]
"""As verl 0.9's Megatron example scripts write them (with the CPU test config's TP 1)."""


def _problems(overrides: list[str], world: int = 2) -> list[str]:
    try:
        validate(load_config(GRPO, overrides), world)
    except ConfigError as exc:
        return exc.problems
    return []


def test_verl_cp2_overrides_validate_unchanged():
    assert _problems(VERL_CP2) == []


def test_context_parallel_without_packing_is_refused_naming_the_key():
    problems = _problems([*VERL_CP2[1:3], f"{ARR}.model.use_remove_padding=false"])
    assert problems == [
        (
            f"{ARR}.actor.megatron.context_parallel_size=2 splits packed sequences: "
            f"{ARR}.model.use_remove_padding must be true"
        )
    ]
    problems = _problems([*VERL_CP2[1:3], f"{ARR}.ref.megatron.use_remove_padding=false"])
    assert len(problems) == 1 and f"{ARR}.ref.megatron.use_remove_padding" in problems[0]


def test_which_models_pack():
    cfg = load_config(GRPO, [])
    arr = cfg.actor_rollout_ref
    assert packs(arr.model, arr.actor.megatron)  # verl's Megatron default: packed
    cfg = load_config(GRPO, [f"{ARR}.model.use_remove_padding=false"])
    arr = cfg.actor_rollout_ref
    assert not packs(arr.model, arr.actor.megatron) and not packs(arr.model, arr.ref.megatron)
    cfg = load_config(GRPO, [f"{ARR}.model.use_remove_padding=false",
                             f"{ARR}.ref.megatron.use_remove_padding=true"])  # fmt: skip
    arr = cfg.actor_rollout_ref
    assert packs(arr.model, arr.ref.megatron) and not packs(arr.model, arr.actor.megatron)
