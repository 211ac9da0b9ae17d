"""Two ranks share the scoring of one global batch: every sample is scored exactly once."""

from __future__ import annotations

from collections import Counter

import pytest

from megarl.parallel.spawn import run_local_world
from tests.reward._files import RECORDING


class CharTokenizer:
    """Token id = character code; enough for the manager, which only decodes."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def rank_body(reward_file: str, log: str, texts: list[str]) -> dict:
    """Score the same global list on every rank; then a batch whose sample 1 raises."""
    import torch.distributed as dist

    from megarl.reward.loader import ScorerSpec
    from megarl.reward.manager import RewardError, RewardInput, RewardManager

    dist.init_process_group("gloo")
    batch = [
        RewardInput("src" if i % 3 else "other", [ord(c) for c in t], "", {"i": i})
        for i, t in enumerate(texts)
    ]
    spec = ScorerSpec(reward_file, "compute_score", {"log": log})
    with RewardManager(CharTokenizer(), spec, num_workers=2, timeout_s=30) as manager:
        result = manager(batch)
        bad = [
            RewardInput("src", [ord(c) for c in t], "", {"i": 100 + i})
            for i, t in enumerate(["a", "boom", "c"])
        ]
        try:
            manager(bad)
            error = ""
        except RewardError as exc:
            error = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    return {
        "scores": result.scores.tolist(),
        "tokens": result.token_level_rewards.tolist(),
        "metrics": result.metrics,
        "error": error,
    }


@pytest.mark.multirank
def test_two_ranks_score_each_sample_once_and_share_the_results(tmp_path):
    reward_file = tmp_path / "recording.py"
    reward_file.write_text(RECORDING)
    log = tmp_path / "calls.txt"
    texts = ["a", "bb", "ccc", "dddd", "e", "ff", "ggg"]
    ranks = run_local_world(rank_body, 2, (str(reward_file), str(log), texts))

    calls = [line.split() for line in log.read_text().splitlines()]
    first = [(int(i), rank) for i, rank in calls if int(i) < 100]
    assert Counter(i for i, _ in first) == Counter(range(len(texts)))  # each exactly once
    assert {i: rank for i, rank in first} == {i: str(i % 2) for i in range(len(texts))}

    expected = [float(i) for i in range(len(texts))]
    for r in ranks:
        assert r["scores"] == expected
        for i, row in enumerate(r["tokens"]):
            assert row[len(texts[i]) - 1] == expected[i] and sum(row) == expected[i]
        assert r["metrics"]["reward/src/count"] == 4.0
        assert r["metrics"]["reward/other/mean"] == (0 + 3 + 6) / 3
    assert ranks[0]["error"] == ranks[1]["error"]  # every rank fails the step the same way
    assert "sample 1 (data_source='src')" in ranks[0]["error"]
    assert "RuntimeError: bad sample" in ranks[0]["error"]
