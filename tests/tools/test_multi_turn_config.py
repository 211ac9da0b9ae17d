"""``actor_rollout_ref.rollout.multi_turn.*``: verl's keys load into the typed config, and what
megarl cannot do with them is refused in one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.config.verl_keys import unsupported_reason

GRPO = str(Path(__file__).resolve().parents[2] / "configs/grpo_tiny_cpu.yaml")
MT = "actor_rollout_ref.rollout.multi_turn"


def errors(tmp_path, *overrides: str) -> list[str]:
    (tmp_path / "tools.yaml").write_text("tools: []\n")
    try:
        validate(
            load_config(GRPO, [f"{MT}.tool_config_path={tmp_path / 'tools.yaml'}", *overrides]), 2
        )
    except ConfigError as exc:
        return [line for line in str(exc).splitlines() if MT in line]
    return []


def test_verl_keys_load_and_are_no_longer_unsupported():
    cfg = load_config(GRPO, [f"{MT}.max_assistant_turns=5", f"{MT}.max_parallel_calls=2",
                             f"{MT}.tool_response_truncate_side=left", f"{MT}.format=hermes",
                             f"{MT}.tokenization_sanity_check_mode=ignore_strippable"])  # fmt: skip
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert (mt.max_assistant_turns, mt.max_parallel_calls) == (5, 2)
    assert mt.tool_response_truncate_side == "left"
    assert unsupported_reason(f"{MT}.enable") is None
    assert unsupported_reason("actor_rollout_ref.rollout.agent.num_workers") is not None


def test_disabled_settings_validate(tmp_path):
    assert errors(tmp_path) == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([f"{MT}.format=gpt-oss"], "format=gpt-oss is not built; use hermes"),
        ([f"{MT}.max_parallel_calls=0"], "max_parallel_calls=0 must be positive"),
        ([f"{MT}.use_inference_chat_template=true"], "use_inference_chat_template=true"),
        ([f"{MT}.num_repeat_rollouts=2"], "num_repeat_rollouts"),
        ([f"{MT}.enable=true", "actor_rollout_ref.rollout.nnodes=1"], "vLLM on ranks of its own"),
        ([f"{MT}.enable=true"], "trainer does not start it yet"),
    ],
)
def test_refusals_name_the_key_in_one_line(tmp_path, overrides, expected):
    found = errors(tmp_path, *overrides)
    assert any(expected in line for line in found), found


def test_enable_without_tools_or_interactions_is_refused():
    with pytest.raises(ConfigError, match="needs .*tool_config_path, function_tool_path or"):
        validate(load_config(GRPO, [f"{MT}.enable=true"]), 2)


def test_a_missing_tool_file_is_named(tmp_path):
    cfg = load_config(GRPO, [f"{MT}.interaction_config_path={tmp_path / 'nope.yaml'}"])
    assert any("nope.yaml" in w and "does not exist" in w for w in validate(cfg, 2))
