"""The config's name lists agree with megarl.algo's registries (when torch is installed)."""

from __future__ import annotations

import typing

import pytest

from megarl.config import (
    ADV_ESTIMATORS,
    KL_TYPES,
    LOSS_AGG_MODES,
    POLICY_LOSS_MODES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_LOG_PROB_MODES,
)
from megarl.config.schema import KLCtrlConfig


def test_choices_match_the_algorithm_registries():
    pytest.importorskip("torch")
    algo = pytest.importorskip("megarl.algo")
    from megarl.algo import registry

    assert sorted(ADV_ESTIMATORS) == registry.ADV_ESTIMATORS.names()
    assert sorted(KL_TYPES) == registry.KL_ESTIMATORS.names()
    assert sorted(POLICY_LOSS_MODES) == registry.POLICY_LOSSES.names()
    assert set(LOSS_AGG_MODES) == set(algo.LOSS_AGG_MODES)
    assert set(ROLLOUT_IS_LEVELS) == set(algo.rollout_correction.ROLLOUT_IS_LEVELS)
    assert ROLLOUT_LOG_PROB_MODES == algo.rollout_correction.ROLLOUT_LOG_PROB_MODES
    kl_ctrl_types = typing.get_args(typing.get_type_hints(KLCtrlConfig)["type"])
    assert set(kl_ctrl_types) == set(algo.KL_CONTROLLER_TYPES)
