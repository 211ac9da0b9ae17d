"""One process: warm-start a tiny Qwen2 to call tools, start real vLLM (CPU, fp32), run the
multi-turn loop, build the trainer's batch, and record everything for test_multi_turn.py.

Prompts of four kinds, each memorised by the warm start: ``add`` (two calculator calls, then
an answer), ``boom`` (a tool that raises), ``wait`` (a tool that hangs past the time limit) and
``oops`` (a call that is not JSON). Transformers' log-probs of every trajectory are recorded
as the independent reference for vLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)

    from megarl.models.tiny import make_tiny_model
    from megarl.tools.warm_start import warm_start_chat

    tools = {
        "calculator": CalculatorTool({}, None),
        "boom": BoomTool({}, _schema("boom")),
        "sleepy": SleepyTool({}, _schema("sleepy")),
    }
    model_dir = make_tiny_model(out / "tiny", "qwen2", seed=0)
    loss = warm_start_chat(model_dir, conversations(tools), steps=300)

    from megarl.rollout.multi_turn import (
        MultiTurnSettings,
        TrajectoryPrompt,
        multi_turn_metrics,
        rollout_samples,
        run_multi_turn,
    )
    from megarl.rollout.vllm_engine import VLLMEngine
    from megarl.trainer.batch import rollout_batch

    engine = VLLMEngine(model_dir, tensor_parallel_size=1, dtype="float32", max_model_len=512)

    def generate(contexts, *, prompt_ids, max_tokens, seed):
        return engine.generate(
            contexts, n=1, temperature=TEMPERATURE, max_tokens=max_tokens, seed=seed,
            prompt_ids=prompt_ids,
        )  # fmt: skip

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [TrajectoryPrompt([{"role": "user", "content": u}], i) for i, u in enumerate(SCRIPTS)]
    settings = MultiTurnSettings(
        response_length=256,
        max_assistant_turns=4,
        tool_call_timeout_s=TIMEOUT_S,
        max_model_len=512,
    )
    n = 4
    trajs = run_multi_turn(
        generate, prompts, n=n, tokenizer=tokenizer, tools=tools, settings=settings,
        seed=0, step=0, stop_token_ids=engine.eos_token_ids,
    )  # fmt: skip
    samples = rollout_samples(trajs, n)
    batch = rollout_batch(
        [s.prompt_token_ids for s in samples],
        [s.response_token_ids for s in samples],
        [s.response_logprobs for s in samples],
        [s.prompt_id for s in samples],
        [s.finish_reason == "length" for s in samples],
        pad_token_id=1,
        token_masks=[s.response_mask for s in samples],
    )
    reference = hf_log_probs(model_dir, trajs)
    record = {
        "warm_start_loss": loss,
        "eos": engine.eos_token_ids,
        "metrics": multi_turn_metrics(trajs),
        "trajectories": [
            {
                "prompt_index": t.prompt_index,
                "prompt_ids": t.prompt_ids,
                "response_ids": t.response_ids,
                "logprobs": t.response_logprobs,
                "mask": t.response_mask,
                "messages": t.messages,
                "assistant_turns": t.assistant_turns,
                "user_turns": t.user_turns,
                "errors": [r.error.value for r in t.tool_results],
                "tool_texts": [r.text for r in t.tool_results],
                "tokenization_ok": t.tokenization_ok,
                "drifted_turns": t.drifted_turns,
                "hf_logprobs": ref,
                "batch_mask": batch.response_mask[i, : len(t.response_ids)].tolist(),
                "batch_mask_tail": batch.response_mask[i, len(t.response_ids) :].tolist(),
                "batch_logprobs": batch.rollout_log_probs[i, : len(t.response_ids)].tolist(),
            }
            for i, (t, ref) in enumerate(zip(trajs, reference, strict=True))
        ],
    }
    (out / "record.json").write_text(json.dumps(record))
    engine.shutdown()


if __name__ == "__main__":
    main()
