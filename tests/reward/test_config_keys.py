"""The data/reward config keys: defaults, and validation messages that name the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate

GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"


def test_defaults():
    cfg = load_config([])
    assert cfg.reward_model.num_workers == 2
    assert cfg.reward_model.compute_score_timeout == 30.0
    assert cfg.reward_model.dump_samples == 16
    assert cfg.trainer.rollout_data_dir is None and cfg.trainer.validation_data_dir is None
    assert cfg.data.use_chat_template is True and cfg.data.apply_chat_template_kwargs == {}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("reward_model.num_workers=0", "reward_model.num_workers must be >= 1, got 0"),
        (
            "reward_model.compute_score_timeout=0",
            "reward_model.compute_score_timeout must be > 0 seconds, got 0",
        ),
        ("reward_model.dump_samples=-2", "reward_model.dump_samples must be -1 (all) or >= 0"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        validate(load_config([str(GRPO)], [override]), 2)
    assert any(message in p for p in info.value.problems), info.value.problems


def test_the_tiny_config_stays_valid():
    validate(load_config([str(GRPO)]), 2)
