"""Reward timeouts are visible (issue 23): many warn on the console, all of them stop the run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.reward.manager import RewardError
from megarl.trainer.scoring import ALLOW_ALL_TIMEOUTS_ENV, check_timeouts


def _run(lines: list[str]) -> SimpleNamespace:
    cfg = SimpleNamespace(reward_model=SimpleNamespace(compute_score_timeout=30.0))
    return SimpleNamespace(cfg=cfg, console=SimpleNamespace(print=lines.append))


def _scored(*timed_out: bool) -> SimpleNamespace:
    return SimpleNamespace(timed_out=torch.tensor(timed_out, dtype=torch.bool))


def test_half_or_fewer_timeouts_are_quiet_more_warn_and_all_stop(monkeypatch):
    lines: list[str] = []
    check_timeouts(_run(lines), _scored(True, True, False, False), step=3)
    assert lines == []
    check_timeouts(_run(lines), _scored(True, True, True, False), step=3)
    expected = "megarl: warning: step 3: 3 of 4 samples' scoring timed out "
    expected += "(reward_model.compute_score_timeout=30 s) and scored 0"
    assert lines == [expected]
    with pytest.raises(RewardError, match=r"4 of 4 samples.*MEGARL_ALLOW_ALL_REWARD_TIMEOUTS=1"):
        check_timeouts(_run(lines), _scored(True, True, True, True), step=4)
    monkeypatch.setenv(ALLOW_ALL_TIMEOUTS_ENV, "1")
    check_timeouts(_run(lines), _scored(True, True, True, True), step=4)
    assert len(lines) == 2 and "4 of 4" in lines[1]
