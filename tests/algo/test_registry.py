"""Registries: every config name from the seeds is present; unknown names list the valid ones."""

from __future__ import annotations

import pytest

from megarl.algo import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    compute_advantage,
    get_adv_estimator,
    get_kl_estimator,
    get_policy_loss,
)

SEED_ESTIMATORS = [
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "grpo_passk",
]


def test_every_seed_name_is_registered():
    for name in SEED_ESTIMATORS:
        assert callable(get_adv_estimator(name))
    for name in ("kl", "abs", "mse", "low_var_kl", "full", "k1", "k2", "k3"):
        assert callable(get_kl_estimator(name))
    assert callable(get_policy_loss("vanilla")) and callable(get_policy_loss("gpg"))


@pytest.mark.parametrize(
    "getter,registry,bad",
    [
        (get_adv_estimator, ADV_ESTIMATORS, "ppo"),
        (get_policy_loss, POLICY_LOSSES, "clip"),
        (get_kl_estimator, KL_ESTIMATORS, "k4"),
    ],
)
def test_unknown_name_lists_valid_names(getter, registry, bad):
    with pytest.raises(ValueError) as err:
        getter(bad)
    message = str(err.value)
    assert repr(bad) in message
    for name in registry.names():
        assert name in message


def test_compute_advantage_unknown_name():
    with pytest.raises(ValueError, match="grpo_passk"):
        compute_advantage("dapo", token_level_rewards=None)
