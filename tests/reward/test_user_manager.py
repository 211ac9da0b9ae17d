"""A user's own reward manager class (``reward.reward_manager.source=importlib``): built in each
scoring worker as verl 0.9.1's reward loop builds it (``cls(config=, tokenizer=,
compute_score=)``, the custom function with its ``reward_kwargs`` bound), its ``async
run_single`` awaited on a one-sample ``DataProto``-like batch; ``reward_score`` is the score and
``reward_extra_info`` the fields."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.data import PromptSample
from megarl.reward.manager import RewardError, RewardInput, RewardManager, reward_inputs
from megarl.rollout.base import RolloutSample
from tests.config._bad_configs import GRPO

FUNCTION = (
    "def exact(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
    "    return scale * float(solution_str.strip() == ground_truth)\n"
)
MANAGER = """
from megarl.reward.user_manager import RewardManagerBase


class LengthBonus(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score, **kwargs):
        super().__init__(config, tokenizer, compute_score)
        self.bonus = config.reward.reward_kwargs.get("bonus", 0.0)

    async def run_single(self, data):
        item = data[-1:][0]
        responses = item.batch["responses"]
        n = int(item.batch["attention_mask"][-responses.shape[-1]:].sum())
        text = await self.loop.run_in_executor(
            None, lambda: self.tokenizer.decode(responses[:n], skip_special_tokens=True))
        if text == "boom":
            raise ValueError("no")
        score = self.compute_score(
            data_source=item.non_tensor_batch["data_source"], solution_str=text,
            ground_truth=item.non_tensor_batch["reward_model"]["ground_truth"],
            extra_info=item.non_tensor_batch["extra_info"])
        row = item.non_tensor_batch
        return {"reward_score": score + self.bonus * n,
                "reward_extra_info": {"tokens": n, "prompt_tokens": item.batch["prompts"].shape[-1],
                                      "split": row["extra_info"]["split"],
                                      "keys": ",".join(sorted(row["extra_info"])),
                                      "turns": int(row.get("__num_turns__", -1)),
                                      "tools": str(row.get("tool_extra_fields", "-"))}}
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("user_manager")
    tokenizer.save_pretrained(root / "tok")
    (root / "fn.py").write_text(FUNCTION)
    (root / "mgr.py").write_text(MANAGER)
    return root


def _overrides(root) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={root / 'tok'}",
        "reward.reward_manager.source=importlib",
        f"reward.reward_manager.module.path={root / 'mgr.py'}",
        "reward.reward_manager.name=LengthBonus",
        f"reward.custom_reward_function.path={root / 'fn.py'}",
        "reward.custom_reward_function.name=exact",
        "+reward.custom_reward_function.reward_kwargs.scale=2.0",
        "+reward.reward_kwargs.bonus=0.25",
    ]


def test_a_users_manager_class_scores_in_the_workers_with_verls_call(files, tokenizer):
    cfg = load_config(GRPO, _overrides(files))
    with pytest.raises(ConfigError) as err:  # only the tiny model path is missing
        validate(cfg)
    assert all("reward" not in p for p in err.value.problems), err.value.problems
    prompt = tokenizer.encode("what is 1 plus 1 ?", add_special_tokens=False)
    right, wrong = (tokenizer.encode(t, add_special_tokens=False) for t in ("2", "11 or 3"))
    samples = [RewardInput("src", ids, "2", {"split": "x"}, prompt_ids=prompt)
               for ids in (right, wrong)]  # fmt: skip
    # a multi-turn response: its record where verl's agent loop puts it, not in extra_info
    record = {"num_turns": 4, "tool_rewards": [0.25], "turn_scores": [1.0]}
    samples += reward_inputs(
        tokenizer, [PromptSample(0, prompt, "q", "src", "2", extra_info={"split": "x"})],
        [RolloutSample(0, 0, prompt, right, [0.0] * len(right), "stop", prompt_id=0,
                       extra=record)],
    )  # fmt: skip
    with RewardManager.from_config(cfg, tokenizer) as manager:
        result = manager(samples)
        # exact x scale 2.0 (the function's reward_kwargs) + 0.25 per response token
        assert result.scores.tolist() == pytest.approx(
            [2.0 + 0.25 * len(right), 0.25 * len(wrong), 2.0 + 0.25 * len(right)]
        )
        assert result.fields["tokens"].tolist() == [len(right), len(wrong), len(right)]
        assert result.fields["prompt_tokens"].tolist() == [len(prompt)] * 3
        assert result.extra["keys"] == ["split"] * 3  # extra_info: the prompt's
        assert result.fields["turns"].tolist() == [-1, -1, 4]
        tools = "{'turn_scores': [1.0], 'tool_rewards': [0.25]}"
        assert result.extra["tools"] == ["-", "-", tools]
        boom = RewardInput("src", tokenizer.encode("boom", add_special_tokens=False), "2",
                           {"split": "x"}, prompt_ids=prompt)  # fmt: skip
        with pytest.raises(RewardError, match="ValueError: no"):
            manager([boom])


def test_a_users_manager_needs_its_file_and_class():
    problems = []
    for extra in (["reward.reward_manager.source=importlib"],
                  ["reward.reward_manager.source=importlib", "reward.reward_manager.module.path=x.py"]):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            validate(load_config(GRPO, extra))
        problems += [p for p in err.value.problems if "reward_manager" in p]
    assert problems == [
        (
            "reward.reward_manager.source=importlib needs reward.reward_manager.module.path "
            "(the file of your class)"
        ),
        (
            "reward.reward_manager.source=importlib needs reward.reward_manager.name (your class's "
            "name, as verl)"
        ),
    ]


def test_the_preflight_names_the_managers_key_and_file_in_one_line(tmp_path, tiny_overrides):
    """Issue 53: a class file that is missing or does not import passed the
    pre-flight; the ranks then reported it ~30 s later as "a scoring worker for
    default_compute_score (built-in) failed to start: ... custom_reward_function.path=...".
    The pre-flight (what ``megarl train`` runs before any rank works) now says it in one line."""
    from megarl.commands.train import preflight
    from tests.conftest import REPO

    (tmp_path / "broken.py").write_text("import no_such_module_megarl_test\n")
    key = "reward.reward_manager.module.path"
    cases = [
        ("missing.py", f"{key}='{tmp_path / 'missing.py'}': no such file"),
        ("broken.py", f"{key}='{tmp_path / 'broken.py'}' failed to load: ModuleNotFoundError"),
    ]
    for name, line in cases:
        problem, _, _ = preflight(
            [str(REPO / "configs" / "grpo_tiny_cpu.yaml")],
            [*tiny_overrides, f"trainer.default_local_dir={tmp_path / 'run'}",
             "reward.reward_manager.source=importlib", "reward.reward_manager.name=Mine",
             f"{key}={tmp_path / name}"],
        )  # fmt: skip
        assert problem is not None and problem.startswith(line), (name, problem)
        assert "\n" not in problem and "custom_reward_function" not in problem
