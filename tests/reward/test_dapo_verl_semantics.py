"""The dapo reward manager as verl 0.9.1 runs it (issue 52), through megarl's real reward
manager (scoring workers) and the trainer's own filter (``megarl.trainer.step.filter_metric``):

- DAPO's dynamic sampling filters ``score`` and ``acc`` on what the manager recorded before the
  overlong penalty (verl's DAPO trainer reads ``non_tensor_batch[metric]``, the reward loop's
  ``reward_extra_info``), ``seq_reward`` on the reward after it;
- a multi-turn response's ``num_turns``, ``tool_rewards``, ``turn_scores`` and
  ``rollout_reward_scores`` reach ``extra_info`` under the naive manager only (verl 0.9.1's
  reward loop: naive and remote add them, dapo and gdpo do not; a user's class finds the record
  where verl's agent loop puts it: tests/reward/test_user_manager.py).
"""

from __future__ import annotations

import pytest
import torch

from megarl.algo.filter_groups import kept_group_rows
from megarl.config import load_config
from megarl.data import PromptSample
from megarl.reward.manager import RewardManager, result_rows, reward_inputs
from megarl.rollout.base import RolloutSample
from megarl.trainer.step import filter_metric

CORRECT = """
def as_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "pred": "right"}


def plain(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def keys(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.0, "keys": ",".join(sorted(extra_info or {}))}
"""
LENGTHS = [700, 800, 900, 1000]
"""Issue 52's group: four correct answers, max_resp_len 1024, buffer 256 (penalty past 768)."""
BUFFER = [
    "reward.reward_manager.name=dapo", "data.max_response_length=1024",
    "reward.reward_kwargs.overlong_buffer_cfg.enable=true",
    "reward.reward_kwargs.overlong_buffer_cfg.len=256",
    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "reward.reward_kwargs.max_resp_len=1024",
]  # fmt: skip


@pytest.fixture(scope="module")
def scorers(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("dapo_semantics")
    (root / "correct.py").write_text(CORRECT)
    return root


def _score(root, tokenizer, name: str, samples, *overrides):
    cfg = load_config([], [f"custom_reward_function.path={root / 'correct.py'}",
                           f"custom_reward_function.name={name}", *overrides])  # fmt: skip
    with RewardManager.from_config(cfg, tokenizer) as manager:
        return manager(samples)


def _group(tokenizer):
    word = tokenizer.encode("a", add_special_tokens=False)
    prompt = PromptSample(0, [1], "q", "src", "right")
    samples = [RolloutSample(0, j, [1], word * n, [0.0] * n, "length", prompt_id=0)
               for j, n in enumerate(LENGTHS)]  # fmt: skip
    return reward_inputs(tokenizer, [prompt], samples)


@pytest.mark.parametrize(("name", "metric"), [("as_dict", "score"), ("plain", "acc")])
def test_the_filter_reads_the_score_before_the_overlong_penalty(scorers, tokenizer, name, metric):
    """verl sees [1, 1, 1, 1] and drops the group; megarl filtered on the shaped
    [1.0, 0.875, 0.484, 0.094] and trained on it. seq_reward is the shaped reward in both."""
    scored = _score(scorers, tokenizer, name, _group(tokenizer), *BUFFER)
    # by hand: 1 - max(0, length - 768) / 256
    assert scored.scores.tolist() == [1.0, 0.875, 1 - 132 / 256, 1 - 232 / 256]
    index = torch.zeros(4, dtype=torch.long)
    assert filter_metric(metric, scored).tolist() == [1.0] * 4
    assert kept_group_rows(filter_metric(metric, scored), index).tolist() == [False] * 4
    assert filter_metric("seq_reward", scored).tolist() == scored.scores.tolist()
    assert kept_group_rows(filter_metric("seq_reward", scored), index).all()
    # the groups joined from several generation batches keep it too
    joined = result_rows([(scored, [3, 1])], ["src", "src"], [1000, 800], 1000)
    assert filter_metric(metric, joined).tolist() == [1.0, 1.0]
    assert joined.scores.tolist() == [1 - 232 / 256, 0.875]


def test_without_the_buffer_score_is_the_score(scorers, tokenizer):
    scored = _score(scorers, tokenizer, "as_dict", _group(tokenizer))
    assert filter_metric("score", scored).tolist() == scored.scores.tolist() == [1.0] * 4


def _multi_turn(tokenizer):
    prompt = PromptSample(0, [1], "x", "src", "42", extra_info={"index": 7})
    record = {"num_turns": 4, "tool_rewards": [0.25], "turn_scores": [1.0]}
    samples = [RolloutSample(0, 0, [1], [5, 3], [0.0, 0.0], "stop", prompt_id=0, extra=record),
               RolloutSample(0, 1, [1], [5], [0.0], "stop", prompt_id=0)]  # fmt: skip
    return reward_inputs(tokenizer, [prompt], samples)


@pytest.mark.parametrize(
    ("manager", "multi_turn_keys"),
    [
        ("naive", "index,num_turns,rollout_reward_scores,tool_rewards,turn_scores"),
        ("dapo", "index"),
        ("gdpo", "experiment_name,index"),
        ("prime", None),  # verl's prime reads no fields; scored, and nothing else to see
    ],
)
def test_the_rollout_record_reaches_extra_info_under_naive_only(
    scorers, tokenizer, manager, multi_turn_keys
):
    scored = _score(scorers, tokenizer, "keys", _multi_turn(tokenizer),
                    f"reward.reward_manager.name={manager}")  # fmt: skip
    if multi_turn_keys is None:
        assert scored.scores.tolist() == [0.0, 0.0]
        return
    single = "experiment_name,index" if manager == "gdpo" else "index"
    assert scored.extra["keys"] == [multi_turn_keys, single]
