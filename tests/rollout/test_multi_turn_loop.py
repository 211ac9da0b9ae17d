"""The multi-turn loop's control flow without vLLM: a scripted ``generate`` writes given texts
(tokenised canonically, log-prob -0.5 per token) so that the turns the real engine cannot be
steered into cheaply are exercised: interaction turns (verl's GSM8K interaction), the response
budget, ``max_user_turns``, a drifting re-tokenisation. test_multi_turn.py runs the real engine.
"""

from __future__ import annotations

import pytest

from megarl.models.tiny import build_tokenizer
from megarl.rollout.base import RolloutBatch, RolloutSample
from megarl.rollout.multi_turn import (
    MultiTurnSettings,
    TrajectoryPrompt,
    multi_turn_metrics,
    rollout_samples,
    run_multi_turn,
)
from megarl.tools.calculator_tool import CalculatorTool
from megarl.tools.interactions.gsm8k_interaction import CORRECT, INCORRECT, Gsm8kInteraction

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(1000)


def scripted(tokenizer, texts: list[str], calls: list):
    """A generate that answers turn t of every trajectory with ``texts[t]`` + <|im_end|>."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(contexts, *, prompt_ids, max_tokens, seed):
        turn = len(calls)
        calls.append((len(contexts), max_tokens))
        ids = tokenizer(texts[turn], add_special_tokens=False)["input_ids"] + [eot]
        samples = []
        for i, (ctx, pid) in enumerate(zip(contexts, prompt_ids, strict=True)):
            out = ids[:max_tokens]
            finish = "stop" if len(out) == len(ids) else "length"
            samples.append(RolloutSample(i, 0, ctx, out, [-0.5] * len(out), finish, prompt_id=pid))
        return RolloutBatch(samples, 1)

    return generate, [eot]


def run(tokenizer, texts, *, n=1, interactions=None, kwargs=None, **settings):
    calls: list = []
    generate, stops = scripted(tokenizer, texts, calls)
    prompts = [TrajectoryPrompt([{"role": "user", "content": "six times seven"}], 0,
                                interaction_kwargs=kwargs)]  # fmt: skip
    trajs = run_multi_turn(
        generate, prompts, n=n, tokenizer=tokenizer,
        tools={"calculator": CalculatorTool({}, None)}, interactions=interactions,
        settings=MultiTurnSettings(**{"response_length": 200, **settings}),
        seed=0, step=0, stop_token_ids=stops,
    )  # fmt: skip
    return trajs, calls


def test_every_active_trajectory_generates_in_one_call_per_turn(tokenizer):
    trajs, calls = run(tokenizer, [CALL, CALL, "It is 42."], n=3)
    assert [c[0] for c in calls] == [3, 3, 3]
    for t in trajs:
        assert [r.text for r in t.tool_results] == ["42", "42"]
        assert (t.assistant_turns, t.user_turns, t.num_turns) == (3, 2, 6)
        assert t.tokenization_ok is True
        assert t.response_logprobs == [-0.5 if m else 0.0 for m in t.response_mask]
    batch = rollout_samples(trajs, 3)
    assert [s.response_mask for s in batch] == [t.response_mask for t in trajs]
    assert batch[0].extra == {"num_turns": 6, "tool_rewards": [0.0, 0.0], "turn_scores": []}
    assert multi_turn_metrics(trajs)["multi_turn/tool_calls/mean"] == 2.0


def test_the_budget_counts_every_turn_and_the_last_turn_stays_the_models(tokenizer):
    """A turn gets at most the tokens left; a tool turn that would fill the budget is not added
    (verl), so the trajectory ends on the model's turn."""
    full, calls = run(tokenizer, [CALL, CALL, "It is 42."])
    after_first_tool = len(full[0].response_ids) - (
        len(full[0].response_ids) - full[0].response_mask.index(1, full[0].response_mask.index(0))
    )
    trajs, calls = run(tokenizer, [CALL, CALL, "It is 42."], response_length=after_first_tool + 5)
    t = trajs[0]
    assert len(t.response_ids) == after_first_tool + 5
    assert calls[1][1] == 5 and t.finish_reason == "length"
    trajs, _ = run(tokenizer, [CALL, CALL], response_length=after_first_tool)
    t = trajs[0]
    assert (t.assistant_turns, t.user_turns) == (1, 0) and t.response_mask[-1] == 1
    assert len(t.tool_results) == 1  # the call ran; its answer did not fit


def test_turn_limits(tokenizer):
    trajs, calls = run(tokenizer, [CALL] * 5, max_user_turns=1)
    assert (trajs[0].assistant_turns, trajs[0].user_turns) == (2, 1)
    trajs, calls = run(tokenizer, [CALL] * 5, max_assistant_turns=3)
    assert (trajs[0].assistant_turns, trajs[0].user_turns) == (3, 2) and len(calls) == 3


def test_an_interaction_answers_a_turn_without_calls_until_it_is_satisfied(tokenizer):
    interactions = {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}
    kwargs = {"name": "gsm8k", "ground_truth": "42"}
    trajs, _ = run(tokenizer, ["#### 41", "#### 42"], interactions=interactions, kwargs=kwargs)
    t = trajs[0]
    assert [m["role"] for m in t.messages] == ["user", "assistant", "user", "assistant"]
    assert t.messages[2]["content"] == INCORRECT
    assert t.turn_scores == [0.0, 1.0]  # the last turn's feedback (CORRECT) ends it, unsent
    assert CORRECT not in tokenizer.decode(t.response_ids)
    assert t.tokenization_ok is True and sum(t.response_mask) < len(t.response_ids)


def test_a_turn_that_re_tokenises_differently_fails_the_sanity_check(tokenizer):
    """Model ids that are not the canonical tokenisation of their text: the next turn's ids
    come from the renderings alone, and the trajectory fails the strict check."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = tokenizer(CALL, add_special_tokens=False)["input_ids"]
    odd = [i for ch in CALL for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    assert odd != text and tokenizer.decode(odd) == CALL
    turns = iter([odd + [eot], tokenizer("done", add_special_tokens=False)["input_ids"] + [eot]])

    def generate(contexts, *, prompt_ids, max_tokens, seed):
        ids = next(turns)
        return RolloutBatch([RolloutSample(0, 0, contexts[0], ids, [0.0] * len(ids), "stop",
                                           prompt_id=prompt_ids[0])], 1)  # fmt: skip

    prompts = [TrajectoryPrompt([{"role": "user", "content": "x"}], 0)]
    for mode, ok in (("strict", False), ("disable", None)):
        turns = iter(
            [odd + [eot], tokenizer("done", add_special_tokens=False)["input_ids"] + [eot]]
        )
        (t,) = run_multi_turn(
            generate, prompts, n=1, tokenizer=tokenizer,
            tools={"calculator": CalculatorTool({}, None)},
            settings=MultiTurnSettings(response_length=300, tokenization_sanity_check_mode=mode),
            seed=0, step=0, stop_token_ids=[eot],
        )  # fmt: skip
        assert t.tokenization_ok is ok
        assert t.drifted_turns == 1
        assert t.response_ids[: len(odd)] == odd  # the model's ids are kept as sampled


class _RewardingCalculator(CalculatorTool):
    """The calculator with a step reward of 0.25 per call; ``1/0`` raises."""

    async def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("expression") == "1/0":
            raise ZeroDivisionError("division by zero")
        response, _, metrics = await super().execute(instance_id, parameters, **kwargs)
        return response, 0.25, metrics


def test_tool_rewards_reach_the_reward_functions_extra_info(tokenizer):
    """As verl: every executed call's step reward, 0.0 for one that raised, none for a call that
    could not be read; the scorer's ``extra_info`` gets them with ``turn_scores``,
    ``num_turns`` and ``rollout_reward_scores`` ({}) on top of the prompt's own fields."""
    from megarl.data import PromptSample
    from megarl.reward.manager import reward_inputs

    raising = CALL.replace("6*7", "1/0")
    malformed = '<tool_call>{"name": calculator}</tool_call>'
    calls: list = []
    generate, stops = scripted(tokenizer, [CALL, raising, malformed, "It is 42."], calls)
    (t,) = run_multi_turn(
        generate, [TrajectoryPrompt([{"role": "user", "content": "x"}], 0)], n=1,
        tokenizer=tokenizer, tools={"calculator": _RewardingCalculator({}, None)},
        settings=MultiTurnSettings(response_length=400), seed=0, step=0, stop_token_ids=stops,
    )  # fmt: skip
    assert [r.error.value for r in t.tool_results] == ["none", "raised", "malformed"]
    assert t.tool_rewards == [0.25, 0.0]
    batch = rollout_samples([t], 1)
    prompt = PromptSample(0, [1], "x", "src", "42", extra_info={"index": 7, "tools_kwargs": {}})
    (scored,) = reward_inputs(tokenizer, [prompt], batch.samples)
    assert scored.extra_info == {
        "index": 7, "tools_kwargs": {}, "turn_scores": [], "tool_rewards": [0.25, 0.0],
        "num_turns": 8, "rollout_reward_scores": {},
    }  # fmt: skip
    assert prompt.extra_info == {"index": 7, "tools_kwargs": {}}  # the prompt's own is kept
    single = RolloutSample(0, 0, [1], [5, 3], [-0.1, -0.1], "stop", prompt_id=0)
    assert reward_inputs(tokenizer, [prompt], [single])[0].extra_info is prompt.extra_info
