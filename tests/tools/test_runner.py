"""run_tool_calls: concurrency, the five outcomes, truncation as verl 0.9.1, instance lifecycles."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from megarl.tools.base_tool import BaseTool
from megarl.tools.gsm8k_tool import Gsm8kTool
from megarl.tools.parser import ToolCall, parse_tool_calls
from megarl.tools.runner import (
    ToolCallError,
    calc_rewards,
    create_instances,
    release_instances,
    run_tool_calls,
    tool_call_metrics,
    truncate_tool_response,
)
from megarl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from tests.tools.conftest import run


def schema(name: str) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": name, "description": name}}
    )


class Scripted(BaseTool):
    """A tool whose execute does what ``parameters["do"]`` says; it records its lifecycle."""

    def __init__(self, name: str, barrier: asyncio.Barrier | None = None):
        super().__init__({}, schema(name))
        self.live: set[str] = set()
        self.created_with: list[dict] = []
        self.barrier = barrier

    async def create(self, instance_id=None, **kwargs):
        instance_id, response = await super().create(instance_id)
        self.live.add(instance_id)
        self.created_with.append(kwargs)
        return instance_id, response

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        do = parameters.get("do")
        if do == "meet":  # returns only once the other call of the turn has started too
            await asyncio.wait_for(self.barrier.wait(), 10)
        if do == "hang":
            await asyncio.Event().wait()
        if do == "raise":
            raise ValueError("bad input\nsecond line")
        if do == "own_timeout":
            raise TimeoutError("upstream service")
        if do == "wrong_shape":
            return "just text"
        return ToolResponse(text=parameters.get("echo", "ok")), 1.0, {"n": 1}

    async def release(self, instance_id: str, **kwargs):
        self.live.remove(instance_id)
        if instance_id == "fail-release":
            raise RuntimeError("release failed")


def call(name: str, **arguments) -> ToolCall:
    import json

    return ToolCall(name, json.dumps(arguments))


def test_calls_of_a_turn_run_concurrently():
    async def scenario():
        tool = Scripted("t", asyncio.Barrier(2))
        results = await run_tool_calls(
            [call("t", do="meet"), call("t", do="meet")], {"t": tool}, max_parallel_calls=2,
            tools_kwargs={"t": {"create_kwargs": {"k": 1}}},
        )  # fmt: skip
        return tool, results

    tool, results = run(scenario())
    assert [r.error for r in results] == [ToolCallError.NONE] * 2
    assert tool.live == set() and tool.created_with == [{"create_kwargs": {"k": 1}}] * 2


def test_only_the_first_max_parallel_calls_run():
    tool = Scripted("t")
    results = run(run_tool_calls([call("t", echo=str(i)) for i in range(3)], {"t": tool},
                                 max_parallel_calls=2))  # fmt: skip
    assert [r.text for r in results] == ["0", "1"]


def test_every_failure_becomes_a_message(caplog):
    """Each failure is the model's message and, as verl, a warning in the rank's log with that
    text (a raising tool, a wrong return: before, only the error counts showed them)."""
    tool = Scripted("t")
    turn = parse_tool_calls("<tool_call>{oops</tool_call>")
    calls = [
        turn.calls[0],
        call("nope"),
        ToolCall("t", "not json"),
        ToolCall("t", "[1]"),
        call("t", do="raise"),
        call("t", do="hang"),
        call("t", do="own_timeout"),
        call("t", do="wrong_shape"),
        call("t"),
    ]
    with caplog.at_level("WARNING", logger="megarl.tools.runner"):
        results = run(run_tool_calls(calls, {"t": tool}, timeout_s=0.3, max_parallel_calls=9))
    got = [(r.error, r.text) for r in results]
    warned = [r.getMessage() for r in caplog.records if r.name == "megarl.tools.runner"]
    expected = [f"tool call {calls[i].name!r} failed ({kind.value}): {text}"
                for i, (kind, text) in enumerate(got[:8])]  # fmt: skip
    assert sorted(warned) == sorted(expected)  # the calls run concurrently
    assert got[0][0] is ToolCallError.MALFORMED and got[0][1].startswith(
        "Malformed tool call: not valid JSON"
    )
    assert got[1] == (ToolCallError.UNKNOWN, "Unknown function 'nope'. Available tools: ['t']")
    assert got[2][0] is ToolCallError.MALFORMED and got[2][1].startswith(
        "Invalid JSON in arguments for 't'"
    )
    assert got[3] == (ToolCallError.MALFORMED, "Arguments for 't' must be a JSON object")
    assert got[4] == (ToolCallError.RAISED, "Error executing tool 't': bad input")
    assert got[5] == (ToolCallError.TIMEOUT, "Error executing tool 't': timed out after 0.3 s")
    assert got[6] == (
        ToolCallError.RAISED,
        "Error executing tool 't': TimeoutError: upstream service",
    )
    assert (
        got[7][0] is ToolCallError.RAISED
        and "expected (ToolResponse, reward, metrics)" in got[7][1]
    )
    assert (
        got[8][0] is ToolCallError.NONE
        and results[8].reward == 1.0
        and results[8].metrics == {"n": 1}
    )
    assert all(r.reward == 0.0 and r.metrics == {} for r in results[:8])
    assert tool.live == set()  # the timed-out and failed instances were released too
    metrics = tool_call_metrics(results)
    assert {k: v for k, v in metrics.items() if k != "tool/seconds"} == {
        "tool/calls": 9.0, "tool/errors/malformed": 3.0, "tool/errors/unknown": 1.0,
        "tool/errors/raised": 3.0, "tool/errors/timeout": 1.0,
    }  # fmt: skip
    assert metrics["tool/seconds"] == pytest.approx(sum(r.seconds for r in results))


def test_a_failing_release_does_not_change_the_result():
    tool = Scripted("t")
    instance = {"t": "fail-release"}

    async def scenario():
        await tool.create("fail-release")
        results = await run_tool_calls([call("t")], {"t": tool}, instance_ids=instance)
        await release_instances({"t": tool}, instance)
        return results

    (result,) = run(scenario())
    assert result.error is ToolCallError.NONE and tool.live == set()


# verl 0.9.1's ToolAgentLoop._call_tool, for max_tool_response_length=4 on "abcdefghij"
@pytest.mark.parametrize(
    ("side", "expected"),
    [
        ("left", "(truncated)...ghij"),
        ("right", "abcd...(truncated)"),
        ("middle", "ab...(truncated)...ij"),
    ],
)
def test_truncation_as_verl(side, expected):
    assert truncate_tool_response("abcdefghij", 4, side) == expected
    assert truncate_tool_response("abcd", 4, side) == "abcd"
    (result,) = run(run_tool_calls([call("t", echo="abcdefghij")], {"t": Scripted("t")},
                                   max_tool_response_length=4, tool_response_truncate_side=side))  # fmt: skip
    assert result.text == expected == result.response.text


def test_odd_lengths_and_bad_sides():
    assert truncate_tool_response("abcdefghij", 5, "middle") == "ab...(truncated)...ij"
    with pytest.raises(ValueError, match="tool_response_truncate_side"):
        truncate_tool_response("x", 1, "centre")


def test_trajectory_scoped_instances_keep_state_and_report_calc_reward():
    tool = Gsm8kTool({})
    tools = {tool.name: tool}

    async def scenario():
        ids = await create_instances(tools, {tool.name: {"create_kwargs": {"ground_truth": "72"}}})
        first = await run_tool_calls([call(tool.name, answer="70")], tools, instance_ids=ids)
        second = await run_tool_calls([call(tool.name, answer="72")], tools, instance_ids=ids)
        rewards = await calc_rewards(tools, ids)
        await release_instances(tools, ids)
        return first[0], second[0], rewards

    first, second, rewards = run(scenario())
    assert (first.reward, second.reward) == (-0.05, 0.0)
    assert rewards == {"calc_gsm8k_reward": 1.0} and tool._instances == {}


def test_a_hung_synchronous_function_tool_is_not_waited_for_even_under_asyncio_run():
    """A sync function tool runs in a daemon thread of the tool pool, which no event loop joins
    at its end: ``asyncio.run`` returns once the time limit answered the call."""
    import threading

    from megarl.tools.function_tool import FunctionTool

    release, finished = threading.Event(), threading.Event()

    def hung():  # returns only once released (or after 8 s): then ``finished`` is set
        release.wait(8)
        finished.set()
        return "late"

    tool = FunctionTool("hang", hung, schema("hang"))
    try:
        (result,) = run(run_tool_calls([call("hang")], {"hang": tool}, timeout_s=0.2))
        tool_still_running = not finished.is_set()  # asyncio.run did not join the tool's thread
    finally:
        release.set()
    assert result.error is ToolCallError.TIMEOUT and tool_still_running


def test_a_turn_is_given_up_when_abort_says_so():
    """ToolEventLoop.run's abort (the trainer's: a rank of the node died) ends a turn whose tool
    still runs, raising TurnAborted with its line; without it the turn runs to its end."""
    from megarl.tools.event_loop import ToolEventLoop, TurnAborted

    loop, asked = ToolEventLoop(), []

    def abort() -> str | None:
        asked.append(1)
        return "a rank ended" if len(asked) >= 2 else None

    try:
        with pytest.raises(TurnAborted, match="a rank ended"):
            loop.run(asyncio.sleep(30), abort=abort, poll_s=0.05)
        assert loop.run(asyncio.sleep(0.01, result="done"), abort=abort, poll_s=5) == "done"
    finally:
        loop.close()
