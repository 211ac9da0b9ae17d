"""verl 0.9's ``reward`` section: both spellings give one config and the same rewards; the
dapo manager's overlong buffer equals verl's formula on hand-computed cases; prime and gdpo
call and read the function as verl's managers do."""

from __future__ import annotations

import pytest
import torch

from megarl.config import ConfigError, load_config, validate
from megarl.reward.loader import ScorerSpec
from megarl.reward.manager import RewardInput, RewardManager
from megarl.reward.overlong import overlong_penalty
from tests.reward._files import CUSTOM

OVERLONG = [
    "reward.reward_manager.name=dapo",
    "reward.reward_kwargs.overlong_buffer_cfg.enable=true",
    "reward.reward_kwargs.overlong_buffer_cfg.len=4",
    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "reward.reward_kwargs.overlong_buffer_cfg.log=true",
    "reward.reward_kwargs.max_resp_len=10",
]


def test_overlong_penalty_equals_verls_formula_by_hand():
    # max_resp_len 10, buffer 4: no penalty up to 6 tokens, then -1/4 per token (factor 1)
    lengths = torch.tensor([0, 5, 6, 7, 8, 10, 12])
    got = overlong_penalty(lengths, max_resp_len=10, buffer_len=4, penalty_factor=1.0)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.5]
    half = overlong_penalty(lengths, max_resp_len=10, buffer_len=4, penalty_factor=0.5)
    assert half.tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.5, -0.75]


@pytest.fixture(scope="module")
def custom_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "my_reward.py"
    path.write_text(CUSTOM)
    return path


def _cfg(custom_file, *overrides):
    return load_config([], [f"custom_reward_function.path={custom_file}",
                            "custom_reward_function.name=my_score", *overrides])  # fmt: skip


def _batch(tokenizer, lengths):
    word = tokenizer.encode("a", add_special_tokens=False)
    return [RewardInput("plain", word * n, "", None) for n in lengths]


def test_the_dapo_manager_shapes_scores_and_logs_verls_fields(custom_file, tokenizer):
    cfg = _cfg(custom_file, *OVERLONG)
    with RewardManager.from_config(cfg, tokenizer) as manager:
        result = manager(_batch(tokenizer, [3, 7, 8]))
    # "plain" scores 0 (no ground truth match); penalties 0, -0.25, -0.5
    assert result.scores.tolist() == [0.0, -0.25, -0.5]
    assert result.fields["overlong_reward"].tolist() == [0.0, -0.25, -0.5]
    assert result.fields["overlong"].tolist() == [0.0, 1.0, 1.0]
    assert result.fields["acc"].tolist() == [0.0, 0.0, 0.0]  # the scorer's own score
    assert result.token_level_rewards[1, 6] == -0.25


def test_both_spellings_give_the_same_config_and_rewards(custom_file, tokenizer):
    new = load_config([], [f"reward.custom_reward_function.path={custom_file}",
                           "reward.custom_reward_function.name=my_score", "reward.num_workers=1",
                           *OVERLONG])  # fmt: skip
    old = load_config([], [f"custom_reward_function.path={custom_file}",
                           "custom_reward_function.name=my_score", "reward_model.num_workers=1",
                           "reward_model.reward_manager=dapo",
                           *[f"+reward_model.{o.removeprefix('reward.')}" for o in OVERLONG[1:]]])  # fmt: skip
    assert new == old
    scores = []
    for cfg in (new, old):
        with RewardManager.from_config(cfg, tokenizer) as manager:
            scores.append(manager(_batch(tokenizer, [2, 9])).scores)
    assert torch.equal(scores[0], scores[1]) and scores[0].tolist() == [0.0, -0.75]


def test_one_setting_given_both_ways_with_different_values_is_one_line(custom_file):
    with pytest.raises(ConfigError) as info:
        load_config([], ["reward.custom_reward_function.path=/a.py",
                         "custom_reward_function.path=/b.py"])  # fmt: skip
    assert str(info.value) == (
        "reward.custom_reward_function.path=/a.py and custom_reward_function.path=/b.py are "
        "one setting (verl 0.9's spelling and the older one) given two values; give one of them"
    )
    with pytest.raises(ConfigError, match="reward.reward_manager.name=dapo and "
                       "reward_model.reward_manager=prime are one setting"):  # fmt: skip
        load_config([], ["reward.reward_manager.name=dapo", "reward_model.reward_manager=prime"])


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["reward.reward_manager.name=batch"],
         "reward.reward_manager.name=batch: megarl's reward managers are naive, dapo, gdpo, prime"),
        (["reward.reward_manager.name=dapo", "reward.reward_kwargs.overlong_buffer_cfg.enable=true",
          "reward.reward_kwargs.overlong_buffer_cfg.len=8"],
         "overlong_buffer_cfg.enable=true needs reward.reward_kwargs.max_resp_len"),
        (["reward.reward_manager.source=importlib"],
         "reward.reward_manager.source=importlib needs reward.reward_manager.module.path"),
        (["reward.reward_model.enable_resource_pool=true"],
         "reward.reward_model.enable_resource_pool=true: the reward model runs on Megatron"),
    ],
)  # fmt: skip
def test_refusals_name_the_values_that_work(overrides, needle):
    with pytest.raises(ConfigError) as info:
        validate(load_config([], overrides), 8)
    assert needle in str(info.value)


def test_prime_calls_positionally_and_scores_a_raise_zero(custom_file, tokenizer):
    spec = ScorerSpec(str(custom_file), "my_score", {}, manager="prime")
    word = tokenizer.encode
    batch = [RewardInput("plain", word("abc", add_special_tokens=False), "abc", None),
             RewardInput("plain", word("boom", add_special_tokens=False), "", None),
             RewardInput("other", word("abcd", add_special_tokens=False), "", None)]  # fmt: skip
    with RewardManager(tokenizer, spec, num_workers=1) as manager:
        result = manager(batch)
    # a match scores 1; the raise scores 0 (verl's prime); a dict result is not a score there
    # ("other" returns a dict: verl reads result[0] of it, which raises, so 0 as well)
    assert result.scores.tolist() == [1.0, 0.0, 0.0] and result.fields == {}


def test_gdpo_hands_the_experiment_name_and_keeps_fields(tmp_path, tokenizer):
    file = tmp_path / "named.py"
    file.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0, 'named': float(extra_info['experiment_name'] == 'exp7')}\n"
    )
    cfg = load_config([], [f"custom_reward_function.path={file}", "custom_reward_function.name=score",
                           "reward.reward_manager.name=gdpo", "trainer.experiment_name=exp7"])  # fmt: skip
    with RewardManager.from_config(cfg, tokenizer) as manager:
        result = manager(_batch(tokenizer, [1]))
    assert result.fields["named"].tolist() == [1.0]
