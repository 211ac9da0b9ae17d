"""Reward manager: custom files by path, fields and metrics, errors, time limit, token rewards."""

from __future__ import annotations

import contextlib
import json
import signal
import sys

import psutil
import pytest
import torch

from megarl.reward.loader import RewardFunctionError, ScorerSpec, load_scorer
from megarl.reward.manager import RewardError, RewardInput, RewardManager
from tests.reward._files import CUSTOM


@contextlib.contextmanager
def hard_timeout(seconds: int):
    """Fail the test instead of hanging (pytest-timeout is not installed)."""

    def fail(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def custom_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "my_reward.py"
    path.write_text(CUSTOM)
    return path


@pytest.fixture(scope="module")
def manager(custom_file, tokenizer):
    spec = ScorerSpec(str(custom_file), "my_score", {"scale": 0.5})
    with RewardManager(tokenizer, spec, num_workers=2, timeout_s=1.0, dump_samples=2) as m:
        yield m


def sample(tokenizer, text, source="src", truth="", eos=False, **extra):
    ids = tokenizer.encode(text, add_special_tokens=False) + (
        [tokenizer.eos_token_id] if eos else []
    )
    return RewardInput(source, ids, truth, extra or None, prompt=f"prompt of {text}")


def test_custom_file_scores_fields_and_metrics(manager, tokenizer, tmp_path):
    path_before = list(sys.path)
    batch = [
        sample(tokenizer, "abc", truth="abc"),
        sample(tokenizer, "hello", eos=True),  # EOS is skipped when decoding, as in verl
        sample(tokenizer, "xy", source="other"),
        sample(tokenizer, "57", source="plain", truth="57"),
    ]
    r = manager(batch, dump_dir=tmp_path, step=3)
    assert r.scores.tolist() == [1.5, 2.5, 1.0, 1.0]  # scale 0.5 from reward_kwargs
    assert r.fields["length"].tolist() == [3.0, 5.0, 2.0, 0.0]  # absent on the plain sample
    assert r.fields["exact"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert r.extra["tag"] == ["t3", "t5", "t2", None]
    assert r.metrics["reward/src/mean"] == 2.0
    assert r.metrics["reward/src/min"] == 1.5 and r.metrics["reward/src/max"] == 2.5
    assert r.metrics["reward/src/count"] == 2.0 and r.metrics["reward/plain/count"] == 1.0
    assert r.metrics["reward/src/length/mean"] == 4.0
    assert "reward/plain/length/mean" not in r.metrics
    assert r.metrics["reward/timeouts"] == 0.0
    assert sys.path == path_before
    rows = [json.loads(line) for line in (tmp_path / "3.jsonl").read_text().splitlines()]
    assert len(rows) == 2  # dump_samples
    assert rows[1] == {
        "step": 3,
        "index": 1,
        "data_source": "src",
        "input": "prompt of hello",
        "output": "hello",
        "gts": "",
        "score": 2.5,
        "timeout": False,
        "exact": 0.0,
        "length": 5.0,
        "tag": "t5",
    }


def test_token_level_rewards_sit_on_the_last_valid_token(manager, tokenizer):
    batch = [
        RewardInput("plain", [5, 6, 7], "x"),  # scores 0 ("plain": exact match)
        RewardInput("src", [5, 6], ""),
        RewardInput("src", [5, 6, 7, 8, 9, 10], ""),  # length-truncated: fills the width, no EOS
        RewardInput("src", [], ""),  # empty: no token to carry the reward
    ]
    r = manager(batch, response_width=6)
    scores = r.scores.tolist()
    assert scores[3] == 0.0 and all(s > 0 for s in scores[1:3])
    expected = torch.zeros(4, 6)
    expected[0, 2], expected[1, 1], expected[2, 5] = scores[0], scores[1], scores[2]
    assert torch.equal(r.token_level_rewards, expected)
    assert manager(batch).token_level_rewards.shape == (4, 6)  # default width: longest response
    with pytest.raises(ValueError, match="sample 2 has 6 response tokens, more than"):
        manager(batch, response_width=5)


def test_a_raising_scorer_fails_with_scorer_data_source_and_index(manager, tokenizer, custom_file):
    batch = [sample(tokenizer, "ok"), sample(tokenizer, "ok"), sample(tokenizer, "boom", "gsm")]
    with pytest.raises(RewardError) as info:
        manager(batch)
    message = str(info.value)
    assert "\n" not in message
    assert f"my_score from {custom_file}" in message
    assert "sample 2 (data_source='gsm')" in message
    assert "ValueError: cannot parse boom" in message


def test_a_bool_score_counts_as_one_or_zero_as_in_verl(manager, tokenizer):
    """Issue 40: a bool (Python's or numpy's, plain or under "score") was refused."""
    batch = [sample(tokenizer, text, source, truth="abc") for source in ("bool", "numpy bool")
             for text in ("abc", "abd")]  # fmt: skip
    assert manager(batch).scores.tolist() == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("text", "returned score 'not a number' of type str"),
        ("die", r"worker died \(exit code 3\)"),
    ],
)
def test_bad_results_and_crashes_are_errors_and_the_pool_recovers(
    manager, tokenizer, text, expected
):
    with pytest.raises(RewardError, match=expected):
        manager([sample(tokenizer, text), sample(tokenizer, "fine")])
    assert manager([sample(tokenizer, "fine")]).scores.tolist() == [2.0]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sleeping_scorer_times_out_its_worker_is_killed_and_the_pool_refilled(
    custom_file, tokenizer, workers
):
    spec = ScorerSpec(str(custom_file), "my_score")
    with RewardManager(tokenizer, spec, num_workers=workers, timeout_s=1.0) as m:
        before = set(m.pool.pids)
        batch = [sample(tokenizer, "ab"), sample(tokenizer, "sleep"), sample(tokenizer, "abcd")]
        with hard_timeout(60):
            r = m(batch)
        assert r.timed_out.tolist() == [False, True, False]
        assert r.scores.tolist() == [2.0, 0.0, 4.0]
        assert r.metrics["reward/timeouts"] == 1.0
        assert r.fields["length"].tolist() == [2.0, 0.0, 4.0]
        after = set(m.pool.pids)
        gone = before - after
        assert len(gone) == 1 and len(after) == workers
        assert not psutil.pid_exists(gone.pop())
        assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in after)
        with hard_timeout(60):
            again = m([sample(tokenizer, "abc")] * 4)
        assert again.scores.tolist() == [3.0] * 4 and not again.timed_out.any()


def test_builtin_scorers_through_the_manager(tokenizer):
    with RewardManager(tokenizer, num_workers=1, timeout_s=30) as m:
        r = m(
            [
                sample(tokenizer, "Answer: 5", "math_dapo", "5"),
                sample(tokenizer, "no", "math_dapo", "5"),
                sample(tokenizer, "so #### 72", "openai/gsm8k", "72", eos=True),
            ]
        )
    assert r.scores.tolist() == [1.0, -1.0, 1.0]
    assert r.fields["acc"].tolist() == [1.0, 0.0, 0.0]
    assert r.extra["pred"] == ["5", "[INVALID]", None]
    assert r.metrics["reward/math_dapo/mean"] == 0.0
    assert r.metrics["reward/math_dapo/acc/mean"] == 0.5


def test_an_unknown_data_source_fails_naming_it(tokenizer):
    with RewardManager(tokenizer, num_workers=1) as m, pytest.raises(RewardError) as info:
        m([sample(tokenizer, "x", "my/task")])
    assert "sample 0 (data_source='my/task')" in str(info.value)
    assert "custom_reward_function" in str(info.value)


def test_loader_paths_names_and_errors(custom_file, tmp_path):
    fn = load_scorer(ScorerSpec(str(custom_file), "my_score"))
    assert fn("plain", "a", "a") == 1
    assert fn.__module__.startswith("megarl_reward_my_reward_")
    assert "my_reward" not in sys.modules  # loaded under its own name, not importable by stem
    assert load_scorer(ScorerSpec(f"file://{custom_file}", "my_score")) is fn
    mv = load_scorer(ScorerSpec("megarl.reward.scorers.math_verify"))
    assert mv("any", "\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert load_scorer(ScorerSpec("pkg://megarl.reward.scorers.math_verify")) is mv
    cfg = type("Cfg", (), {"path": "pkg://megarl/reward/scorers/math_verify", "name": None})
    cfg.reward_kwargs = None
    assert load_scorer(ScorerSpec.from_config(cfg)) is mv
    with pytest.raises(RewardFunctionError, match="path='/nope/r.py': no such file"):
        load_scorer(ScorerSpec("/nope/r.py"))
    with pytest.raises(RewardFunctionError, match="name='missing'"):
        load_scorer(ScorerSpec(str(custom_file), "missing"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('needs verl')\n")
    with pytest.raises(RewardFunctionError, match="failed to load: ImportError: needs verl"):
        load_scorer(ScorerSpec(str(broken)))


def test_from_config(custom_file, tokenizer, tmp_path, monkeypatch):
    from megarl.config import load_config

    monkeypatch.chdir(custom_file.parent)
    cfg = load_config(
        [],
        [
            "custom_reward_function.path=my_reward.py",  # relative: resolved once, here
            "custom_reward_function.name=my_score",
            "+custom_reward_function.reward_kwargs.scale=2",
            "reward_model.num_workers=1",
            "reward_model.compute_score_timeout=5",
        ],
    )
    with RewardManager.from_config(cfg, tokenizer) as m:
        assert m.spec.path == str(custom_file) and m.pool.timeout_s == 5.0
        assert len(m.pool.pids) == 1
        assert m([sample(tokenizer, "abc")]).scores.tolist() == [6.0]
