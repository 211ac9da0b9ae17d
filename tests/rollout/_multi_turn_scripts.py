"""What the multi-turn launch (``_multi_turn_launch.py``) teaches a tiny Qwen2 and calls: the
scripted conversations of the warm start, the tools, and the transformers reference.

Prompts of four kinds, each memorised by the warm start: ``add`` (two calculator calls, then
an answer), ``boom`` (a tool that raises), ``wait`` (a tool that hangs past the time limit) and
``oops`` (a call that is not JSON). Transformers' log-probs of every trajectory are recorded
as the independent reference for vLLM's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from megarl.tools.base_tool import BaseTool
from megarl.tools.calculator_tool import CalculatorTool
from megarl.tools.parser import parse_tool_calls
from megarl.tools.runner import run_tool_calls
from megarl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

TIMEOUT_S = 0.5
TEMPERATURE = 1.0


def _schema(name: str) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": name,
                "description": name,
                "parameters": {"type": "object", "properties": {}, "required": []},
            },
        }
    )


class BoomTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("boom")


class SleepyTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(60)
        return ToolResponse(text="woke"), 0.0, {}


def call(name: str, args: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


SCRIPTS = {
    "add 12 and 30": [
        call("calculator", '{"expression": "12+30"}'),
        call("calculator", '{"expression": "42*2"}'),
        "The answer is 84.",
    ],
    "boom": [call("boom", "{}"), "The tool failed."],
    "wait": [call("sleepy", "{}"), "The tool timed out."],
    "oops": ['<tool_call>{"name": calculator}</tool_call>', "The call was bad."],
}
"""User prompt → the assistant turns the warm start teaches (tool turns come from the tools)."""


def conversations(tools) -> list[list[dict]]:
    out = []
    for user, turns in SCRIPTS.items():
        messages = [{"role": "user", "content": user}]
        for text in turns:
            messages.append({"role": "assistant", "content": text})
            calls = parse_tool_calls(text).calls
            if calls:
                results = asyncio.run(run_tool_calls(calls, tools, timeout_s=TIMEOUT_S))
                messages += [{"role": "tool", "content": r.text} for r in results]
        out.append(messages)
    return out


def hf_log_probs(model_dir: Path, trajs) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logits = model(input_ids=ids).logits[0, len(t.prompt_ids) - 1 : -1] / TEMPERATURE
            lp = torch.log_softmax(logits.double(), -1)
            out.append(lp.gather(-1, ids[0, len(t.prompt_ids) :, None])[:, 0].tolist())
    return out


def make_tools() -> dict:
    """The tools the scripts call: the calculator, one that raises, one that hangs."""
    return {
        "calculator": CalculatorTool({}, None),
        "boom": BoomTool({}, _schema("boom")),
        "sleepy": SleepyTool({}, _schema("sleepy")),
    }
