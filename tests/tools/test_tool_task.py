"""The tool task ``megarl/tool_sum``: rows in verl's schema, warm-start conversations whose
tool turns are the calculator's own answers, and a reward only a call earns."""

from __future__ import annotations

import asyncio
import re

from megarl.data.tool_task import (
    DATA_SOURCE,
    compute_score,
    make_tool_rows,
    warm_start_conversations,
)
from megarl.tools.calculator_tool import CalculatorTool
from megarl.tools.parser import parse_tool_calls
from megarl.tools.runner import run_tool_calls


def test_rows_ask_for_a_sum_of_two_six_digit_numbers():
    rows = make_tool_rows(5, split="train", seed=0)
    assert rows == make_tool_rows(5, split="train", seed=0)
    assert rows != make_tool_rows(5, split="test", seed=0)
    for row in rows:
        a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
        assert 10**5 <= a < 10**6 and 10**5 <= b < 10**6
        assert row["reward_model"]["ground_truth"] == str(a + b)
        assert row["data_source"] == DATA_SOURCE


def test_warm_start_tool_turns_are_what_the_calculator_answers():
    tools = {"calculator": CalculatorTool({}, None)}
    for conv in warm_start_conversations(3):
        calls = parse_tool_calls(conv[1]["content"]).calls
        (result,) = asyncio.run(run_tool_calls(calls, tools))
        assert conv[2] == {"role": "tool", "content": result.text}
        assert conv[3]["content"] == result.text


def test_only_a_call_earns_and_the_answer_counts_when_the_tool_gave_the_sum():
    """Half for the call's operands (character credit against ``a+b``), half for the final
    answer's digits, the latter only when a tool turn held the exact sum; a direct answer,
    even right, gets 0."""
    info = {"a": 636022, "b": 423895}  # sum 1059917

    def response(expression: str, tool: str, final: str) -> str:
        call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}'
        return f"{call}</tool_call>\ntool\n{tool}\nassistant\n{final}"

    exact = compute_score(DATA_SOURCE, response("636022+423895", "1059917", "1059917"),
                          "1059917", info)  # fmt: skip
    assert exact == {"score": 1.0, "acc": 1.0, "tool_ok": 1.0}
    half_answer = response("636022+423895", "1059917", "1059000")
    assert compute_score(DATA_SOURCE, half_answer, "1059917", info)["score"] == 0.5 + 0.5 * 4 / 7
    miscopied = response("636064+423825", "1059889", "1059917")  # 10 of 13 characters
    assert compute_score(DATA_SOURCE, miscopied, "1059917", info) == {
        "score": 0.5 * 10 / 13, "acc": 1.0, "tool_ok": 0.0,
    }  # fmt: skip
    assert compute_score(DATA_SOURCE, "1059917", "1059917", info)["score"] == 0.0
