"""The multi-turn loop's control flow without vLLM: a scripted ``generate`` writes given texts
(tokenised canonically, log-prob -0.5 per token) so that the turns the real engine cannot be
steered into cheaply are exercised: interaction turns (verl's GSM8K interaction), the response
budget, ``max_user_turns``, a drifting re-tokenisation. test_multi_turn.py runs the real engine.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import ClassVar

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
    come from the renderings alone, and the trajectory fails the strict check. The tool turn
    still starts with the newline ChatML writes after <|im_end|> (verl 0.9.1's Qwen builder
    inserts it; megarl started the turn at <|im_start|>)."""
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
        # verl's tool turn: "\n" after <|im_end|>, then the tool message and the prompt
        tool_turn = "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
        expected = tokenizer(tool_turn, add_special_tokens=False)["input_ids"]
        first_zero = t.response_mask.index(0)
        assert first_zero == len(odd) + 1
        assert t.response_ids[first_zero : first_zero + len(expected) + 1] == expected + [
            tokenizer("done", add_special_tokens=False)["input_ids"][0]
        ]


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


# -- per-trajectory turn caps, history-rewriting templates, the event loop, interactions --------

LONG = "The answer is forty two, and here is why it is so: six sevens make it."


def rendered(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def capped(tokenizer, limit: int, calls: list):
    """A generate that answers every request with ``LONG`` + <|im_end|>, cut at ``max_tokens``,
    and refuses (as vLLM) a request whose context + max_tokens passes ``limit``."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer(LONG, add_special_tokens=False)["input_ids"] + [eot]

    def generate(contexts, *, prompt_ids, max_tokens, seed):
        calls.append((max_tokens, [len(c) for c in contexts]))
        assert all(len(c) + max_tokens <= limit for c in contexts), "past max_model_len"
        return RolloutBatch([RolloutSample(i, 0, c, ids[:max_tokens], [-0.5] * len(ids[:max_tokens]),
                                           "stop" if max_tokens >= len(ids) else "length",
                                           prompt_id=p)
                             for i, (c, p) in enumerate(zip(contexts, prompt_ids))], 1)  # fmt: skip

    return generate, [eot], ids


def test_each_trajectory_is_capped_by_its_own_context_room(tokenizer):
    """A trajectory near max_model_len gets a short turn; the others their whole answer (the
    room of one no longer caps every request of the turn)."""
    short = [{"role": "user", "content": "hi"}]
    long_ = [{"role": "user", "content": "six times seven " * 12}]
    n_short, n_long = (len(rendered(tokenizer, p)) for p in (short, long_))
    limit = n_long + 6
    calls: list = []
    generate, stops, answer = capped(tokenizer, limit, calls)
    settings = MultiTurnSettings(response_length=200, max_model_len=limit)
    short_t, long_t = run_multi_turn(
        generate, [TrajectoryPrompt(short, 0), TrajectoryPrompt(long_, 1)], n=1,
        tokenizer=tokenizer, tools={}, settings=settings, seed=0, step=0, stop_token_ids=stops,
    )  # fmt: skip
    assert 6 < len(answer) < limit - n_short
    assert (long_t.response_ids, long_t.finish_reason) == (answer[:6], "length")
    assert (short_t.response_ids, short_t.finish_reason) == (answer, "stop")
    assert calls == [(6, [n_long]), (limit - n_short, [n_short])]  # each call within its room
    (alone,) = run_multi_turn(
        capped(tokenizer, limit, [])[0], [TrajectoryPrompt(short, 0)], n=1, tokenizer=tokenizer,
        tools={}, settings=settings, seed=0, step=0, stop_token_ids=stops,
    )  # fmt: skip
    assert alone.response_ids == short_t.response_ids


QWEN3_LIKE = (  # Qwen3's rule: assistant turns before the last user turn lose their <think>
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class Recording(Gsm8kInteraction):
    """verl's GSM8K interaction that records what it is shown and gives no score (None) for
    a wrong answer."""

    seen: ClassVar[list] = []

    async def generate_response(self, instance_id, messages, **kwargs):
        self.seen.append([dict(m) for m in messages])
        done, text, score, extra = await super().generate_response(instance_id, messages, **kwargs)
        return done, text, (score if done else None), extra


def test_a_template_that_rewrites_history_gets_the_user_turn_whole(tokenizer):
    """With a Qwen3-like template the conversation's rendering changes before the new user
    turn: its ids are the user message rendered alone (verl's way), not a slice of text."""
    import copy

    qwen3 = copy.copy(tokenizer)
    qwen3.chat_template = QWEN3_LIKE
    interactions = {"gsm8k": Recording({"name": "gsm8k"})}
    kwargs = {"name": "gsm8k", "ground_truth": "42"}
    first = "<think>\nsix sevens, minus one\n</think>\n\n#### 41"
    calls: list = []
    generate, stops = scripted(qwen3, [first, "#### 42"], calls)
    (t,) = run_multi_turn(
        generate, [TrajectoryPrompt([{"role": "user", "content": "x"}], 0,
                                    interaction_kwargs=kwargs)], n=1,
        tokenizer=qwen3, tools={}, interactions=interactions,
        settings=MultiTurnSettings(response_length=300), seed=0, step=0, stop_token_ids=stops,
    )  # fmt: skip
    user = [i for i, m in zip(t.response_ids, t.response_mask, strict=True) if m == 0]
    newline = qwen3("\n", add_special_tokens=False)["input_ids"]  # after <|im_end|>, as verl
    expected = newline + rendered(qwen3, [{"role": "user", "content": INCORRECT}])
    assert user == expected and t.user_turns == 1 and t.drifted_turns == 1
    assert t.turn_scores == [1.0]  # the None of the wrong answer is no score (verl)


def test_interactions_see_model_text_without_special_tokens_and_none_scores_are_skipped(
    tokenizer,
):
    """verl decodes an assistant turn for the interaction with skip_special_tokens=True; a
    None score is not appended (verl); the template still renders the ids as sampled."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|pad|>")
    turns = iter([tokenizer("#### 41", add_special_tokens=False)["input_ids"] + [pad, eot],
                  tokenizer("#### 42", add_special_tokens=False)["input_ids"] + [eot]])  # fmt: skip

    def generate(contexts, *, prompt_ids, max_tokens, seed):
        ids = next(turns)
        return RolloutBatch([RolloutSample(0, 0, contexts[0], ids, [0.0] * len(ids), "stop",
                                           prompt_id=prompt_ids[0])], 1)  # fmt: skip

    Recording.seen = []
    (t,) = run_multi_turn(
        generate, [TrajectoryPrompt([{"role": "user", "content": "x"}], 0,
                                    interaction_kwargs={"name": "gsm8k", "ground_truth": "42"})],
        n=1, tokenizer=tokenizer, tools={},
        interactions={"gsm8k": Recording({"name": "gsm8k"})},
        settings=MultiTurnSettings(response_length=300), seed=0, step=0, stop_token_ids=[eot],
    )  # fmt: skip
    assert [m[1]["content"] for m in Recording.seen] == ["#### 41", "#### 41"]
    assert Recording.seen[1][3]["content"] == "#### 42"
    assert t.messages[1]["content"] == "#### 41<|pad|>"  # what the template renders
    assert t.turn_scores == [1.0] and t.tokenization_ok is True


class _Locked(CalculatorTool):
    """The calculator behind an asyncio lock made with the tool (it binds to the first event
    loop that waits on it), recording each call's ``agent_data``."""

    def __init__(self):
        super().__init__({}, None)
        self.lock, self.seen = asyncio.Lock(), []

    async def execute(self, instance_id, parameters, **kwargs):
        agent = kwargs["agent_data"]
        self.seen.append((agent, dict(agent.extra_fields), list(agent.prompt_ids),
                          list(agent.response_ids), [m["role"] for m in agent.messages]))  # fmt: skip
        agent.extra_fields["calls"] = agent.extra_fields.get("calls", 0) + 1
        async with self.lock:  # the two trajectories' calls wait on it in turn
            await asyncio.sleep(0.01)
        return await super().execute(instance_id, parameters)


def test_tools_keep_one_event_loop_across_turns_and_steps_and_get_agent_data(tokenizer):
    """MultiTurnRollout keeps one event loop for every step (verl: one per worker), so a tool
    holding asyncio state works from its second turn on; every execute gets verl's
    ``agent_data`` (the trajectory so far; ``extra_fields`` kept across its turns)."""
    from megarl.rollout.multi_turn_rollout import MultiTurnRollout

    calls: list = []
    gen, stops = scripted(tokenizer, [CALL, CALL, "It is 42."] * 2, calls)
    engine = SimpleNamespace(generate=lambda contexts, *, prompt_ids, max_tokens, seed, **_: gen(
        contexts, prompt_ids=prompt_ids, max_tokens=max_tokens, seed=seed))  # fmt: skip
    tool = _Locked()
    rollout = MultiTurnRollout(tokenizer, {"calculator": tool}, {},
                               MultiTurnSettings(response_length=300), stops)  # fmt: skip
    prompt = [TrajectoryPrompt([{"role": "user", "content": "x"}], 0,
                               tools_kwargs={"calculator": {"create_kwargs": {}}})]  # fmt: skip
    for step in range(2):
        trajs = rollout.run(engine, prompt, n=2, sampling={}, seed=0, step=step)
        assert [r.error.value for t in trajs for r in t.tool_results] == ["none"] * 4, step
    t = trajs[1]
    first = t.response_mask.index(0)
    agent, fields, prompt_ids, response_ids, roles = tool.seen[-1]  # its second call
    assert agent.tools_kwargs == {"calculator": {"create_kwargs": {}}}
    assert [s[0] for s in tool.seen[-4:]].count(agent) == 2  # one per trajectory and rollout
    assert fields == {"calls": 1} and len(agent.request_id) == 32
    second = t.response_mask.index(0, t.response_mask.index(1, first))
    assert prompt_ids == t.prompt_ids + t.response_ids[:second]
    assert response_ids == t.response_ids[t.response_mask.index(1, first) : second]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert agent.assistant_turns == 2 and agent.user_turns == 1


def test_a_hung_synchronous_tool_does_not_hold_the_turn_past_its_time_limit(tokenizer):
    """The tool's thread is never joined: the turn ends after tool_call_timeout_s (asyncio.run
    per turn joined it, so a hung tool hung the step)."""
    from megarl.tools.function_tool import FunctionTool
    from megarl.tools.schemas import OpenAIFunctionToolSchema

    release, finished = threading.Event(), threading.Event()

    def hung():  # returns only once released (or after 8 s): then ``finished`` is set
        release.wait(8)
        finished.set()
        return "late"

    schema = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "hang", "description": "hangs"}}
    )
    tool = FunctionTool("hang", hung, schema)
    hang = '<tool_call>{"name": "hang", "arguments": {}}</tool_call>'
    generate, stops = scripted(tokenizer, [hang, "done"], [])
    try:
        (t,) = run_multi_turn(
            generate, [TrajectoryPrompt([{"role": "user", "content": "x"}], 0)], n=1,
            tokenizer=tokenizer, tools={"hang": tool},
            settings=MultiTurnSettings(response_length=300, tool_call_timeout_s=0.3),
            seed=0, step=0, stop_token_ids=stops,
        )  # fmt: skip
        tool_still_running = not finished.is_set()  # the loop did not wait for the tool
    finally:
        release.set()
    assert [r.error.value for r in t.tool_results] == ["timeout"] and t.assistant_turns == 2
    assert tool_still_running


def test_multi_turn_metrics_of_several_batches_merge_as_of_all_trajectories(tokenizer):
    """merge_multi_turn_metrics over batches equals multi_turn_metrics over their trajectories
    together; dynamic sampling logs that over every generation batch of the step."""
    import torch

    from megarl.config import load_config
    from megarl.reward.manager import RewardResult
    from megarl.rollout.multi_turn import merge_multi_turn_metrics
    from megarl.trainer import step as step_module
    from megarl.trainer.batch import batch_from_samples
    from megarl.trainer.metrics import Timer

    unknown = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    parts = [run(tokenizer, [CALL, CALL, "It is 42."], n=2)[0],
             run(tokenizer, [unknown, CALL, "It is 42."], n=2, max_user_turns=1)[0]]  # fmt: skip
    everything = multi_turn_metrics(parts[0] + parts[1])
    assert everything["multi_turn/tool_success_rate"] == 4 / 6  # the batches differ
    merged = merge_multi_turn_metrics([(multi_turn_metrics(p), len(p)) for p in parts])
    assert merged == pytest.approx(everything, rel=1e-12)
    assert merge_multi_turn_metrics([({}, 4)]) == {}

    def generate(engine, prompts, *, n, **_):
        out = rollout_samples(parts[int(prompts[0].name)], n)
        out.metrics = multi_turn_metrics(parts[int(prompts[0].name)])
        return batch_from_samples(out, pad_token_id=0), out

    def score(run_, prompts, samples, batch, step, dump, prescored=None):
        acc = torch.tensor([1.0, 0.0])  # each group varies: kept
        return RewardResult(torch.zeros(2, batch.response_mask.shape[1]), acc, {"acc": acc}, {},
                            torch.zeros(2, dtype=torch.bool))  # fmt: skip

    with pytest.MonkeyPatch.context() as mp:
        for name, fn in (
            ("generate", generate),
            ("score", score),
            ("enter", lambda *a, **k: None),
            ("pad_token_id", lambda tok: 0),
        ):
            mp.setattr(step_module, name, fn)  # fmt: skip
        cfg = load_config([], ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                               "algorithm.filter_groups.enable=true",
                               "algorithm.filter_groups.metric=acc"])  # fmt: skip
        the_run = SimpleNamespace(cfg=cfg, engine=None, tokenizer=None, ahead=None,
                                  engine_residency=None, last_sleep_level=0,
                                  image_width=None)  # fmt: skip
        prompts = [SimpleNamespace(name="0", data_source="toy")]
        batch, samples = generate(None, prompts, n=2)
        scored = score(None, prompts, samples, batch, 1, None)
        more = iter([[SimpleNamespace(name="1", data_source="toy")]])
        *_, metrics = step_module.fill_with_groups(
            the_run, 1, prompts, batch, samples, scored, lambda: (next(more), None), Timer()
        )
    assert metrics["train/num_gen_batches"] == 2.0
    assert {k: v for k, v in metrics.items() if k.startswith("multi_turn/")} == pytest.approx(
        everything, rel=1e-12
    )


def test_a_prompt_over_rollout_prompt_length_is_cut_from_the_left(tokenizer, tmp_path):
    """verl 0.9.1's agent loop keeps the last ``rollout.prompt_length`` ids of a rendered prompt
    (the tools' schemas included: ``_cap_text_prompt_length``); megarl kept it whole. The turns
    after it are still the template's exact deltas."""
    from megarl.config import load_config
    from megarl.rollout.multi_turn import tool_schema
    from megarl.rollout.multi_turn_rollout import MultiTurnRollout

    tools = {"calculator": CalculatorTool({}, None)}
    messages = [{"role": "user", "content": "six times seven"}]
    text = tokenizer.apply_chat_template(
        messages, tools=[tool_schema(t) for t in tools.values()], add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    full = tokenizer(text, add_special_tokens=False)["input_ids"]
    (tools_yaml := tmp_path / "tools.yaml").write_text(
        "tools:\n  - class_name: megarl.tools.calculator_tool.CalculatorTool\n    config: {}\n"
    )
    cfg = load_config([], [f"data.max_prompt_length={len(full) - 7}",
                           "actor_rollout_ref.rollout.multi_turn.enable=true",
                           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools_yaml}"])  # fmt: skip
    calls: list = []
    generate, stops = scripted(tokenizer, [CALL, "It is 42."], calls)
    contexts: list = []

    def engine_generate(ctx, *, prompt_ids, max_tokens, seed, **_):
        contexts.append([list(c) for c in ctx])
        return generate(ctx, prompt_ids=prompt_ids, max_tokens=max_tokens, seed=seed)

    rollout = MultiTurnRollout.from_config(cfg, tokenizer, stops)
    assert rollout.settings.prompt_length == len(full) - 7  # data.max_prompt_length, as verl
    (t,) = rollout.run(SimpleNamespace(generate=engine_generate), [TrajectoryPrompt(messages, 0)],
                       n=1, sampling={}, seed=0, step=0)  # fmt: skip
    assert t.prompt_ids == full[7:] and contexts[0] == [full[7:]]
    assert contexts[1][0][: len(full) - 7] == full[7:]
    assert t.drifted_turns == 0 and t.tokenization_ok is True
    assert [r.text for r in t.tool_results] == ["42"] and t.assistant_turns == 2
