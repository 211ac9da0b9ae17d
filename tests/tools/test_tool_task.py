"""The tool task ``megarl/tool_sum``: rows in verl's schema, warm-start conversations whose
tool turns are the calculator's own answers, and per-digit credit of the final answer only."""

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


def test_only_the_last_assistant_turn_is_scored():
    """The tool turn holds the exact sum; only the model's own final answer counts."""
    response = "calculator call\ntool\n1059889\nassistant\n1095889"
    assert compute_score(DATA_SOURCE, response, "1059889") == {"score": 5 / 7, "acc": 0.0}
    assert compute_score(DATA_SOURCE, "tool\n1059889\nassistant\n1059889", "1059889") == {
        "score": 1.0, "acc": 1.0,
    }  # fmt: skip
    assert compute_score(DATA_SOURCE, "tool\n1059889\nassistant\nno", "1059889")["score"] == 0.0
    assert compute_score(DATA_SOURCE, "assistant\n10598890", "1059889")["score"] == 7 / 8
