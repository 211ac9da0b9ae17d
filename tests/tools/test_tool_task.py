"""The tool task ``megarl/tool_mul``: rows in verl's schema, warm-start conversations whose
tool turns are the calculator's own answers, and a reward only a call earns."""

from __future__ import annotations

import asyncio
import re

from megarl.data.tool_task import (
    CALLS_PER_8,
    DATA_SOURCE,
    compute_score,
    make_tool_rows,
    warm_start_conversations,
)
from megarl.tools.calculator_tool import CalculatorTool
from megarl.tools.parser import parse_tool_calls
from megarl.tools.runner import run_tool_calls


def test_rows_ask_for_a_four_digit_product():
    rows = make_tool_rows(20, split="train", seed=0)
    assert rows == make_tool_rows(20, split="train", seed=0)
    assert rows != make_tool_rows(20, split="test", seed=0)
    for row in rows:
        a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
        assert 32 <= a <= 99 and 32 <= b <= 99
        assert row["reward_model"]["ground_truth"] == str(a * b)
        assert len(str(a * b)) == 4
        assert row["data_source"] == DATA_SOURCE


def test_warm_start_calls_three_in_eight_and_the_tool_turns_are_the_calculators():
    tools = {"calculator": CalculatorTool({}, None)}
    conversations = warm_start_conversations(32)
    calls = [c for c in conversations if len(c) == 4]
    for block in range(0, 32, 16):  # each batch of 16 the warm start takes holds 6 calls
        assert sum(len(c) == 4 for c in conversations[block : block + 16]) == 2 * CALLS_PER_8
    for conv in calls:
        parsed = parse_tool_calls(conv[1]["content"]).calls
        (result,) = asyncio.run(run_tool_calls(parsed, tools))
        assert conv[2] == {"role": "tool", "content": result.text}
        assert conv[3]["content"] == result.text
    for conv in conversations:
        if len(conv) == 2:
            assert re.fullmatch(r"about \d{4}", conv[1]["content"])


def test_only_a_call_earns_and_the_answer_counts_when_the_tool_gave_the_product():
    """0.5 for a tool turn holding the exact product, 0.5 more for the final answer; a
    direct answer, even right, gets 0."""

    def response(expression: str, tool: str, final: str) -> str:
        call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}'
        return f"{call}</tool_call>\ntool\n{tool}\nassistant\n{final}"

    truth = "2146"  # 37 * 58
    score = lambda text: compute_score(DATA_SOURCE, text, truth, {"a": 37, "b": 58})
    assert score(response("37*58", "2146", "2146")) == {"score": 1.0, "acc": 1.0, "tool_ok": 1.0}
    assert score(response("37*58", "2146", "2140")) == {"score": 0.5, "acc": 0.0, "tool_ok": 1.0}
    assert score(response("37*53", "1961", "2146")) == {"score": 0.0, "acc": 1.0, "tool_ok": 0.0}
    assert score("2146") == {"score": 0.0, "acc": 1.0, "tool_ok": 0.0}
    assert score("about 2146")["score"] == 0.0
