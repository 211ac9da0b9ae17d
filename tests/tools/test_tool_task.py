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
    """0.5 for a tool turn holding the exact product, 0.5 x the final answer's digits in place
    then; a direct answer, even right, gets 0."""

    def response(expression: str, tool: str, final: str) -> str:
        call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}'
        return f"{call}</tool_call>\ntool\n{tool}\nassistant\n{final}"

    truth = "2146"  # 37 * 58
    score = lambda text: compute_score(DATA_SOURCE, text, truth, {"a": 37, "b": 58})
    right = {"score": 1.0, "acc": 1.0, "tool_ok": 1.0, "digits": 1.0}
    assert score(response("37*58", "2146", "2146")) == right
    assert score(response("37*58", "2146", "2140")) == {
        "score": 0.5 + 0.5 * 3 / 4, "acc": 0.0, "tool_ok": 1.0, "digits": 3 / 4,
    }  # fmt: skip
    assert score(response("37*58", "2146", "21460"))["digits"] == 4 / 5  # over the longer
    assert score(response("37*53", "1961", "2146")) == {
        "score": 0.0, "acc": 1.0, "tool_ok": 0.0, "digits": 1.0,
    }  # fmt: skip
    assert score("2146") == {"score": 0.0, "acc": 1.0, "tool_ok": 0.0, "digits": 1.0}
    assert score("about 2146")["score"] == 0.0


def test_warm_start_step_by_length_is_the_padded_batchs_gradient(tmp_path):
    """Rows of a step grouped by length and run unpadded give the loss and the gradient of one
    right-padded batch (attention mask, -100 labels) within 1e-5: the same arithmetic."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.models.tiny import make_tiny_model
    from megarl.tools.warm_start import assistant_token_mask, backward_by_length

    path = make_tiny_model(tmp_path / "tiny", "qwen2", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = [assistant_token_mask(tokenizer, c, eot) for c in warm_start_conversations(16)]
    lengths = [len(ids) for ids, _ in rows]
    assert len(set(lengths)) == 2  # calls and guesses
    width = max(lengths)
    ids = torch.full((16, width), 1)
    labels = torch.full((16, width), -100)
    for r, (row, mask) in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        labels[r, : len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, mask)])
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    pick = [3, 0, 7, 12, 5, 9]
    assert len({lengths[r] for r in pick}) == 2
    loss = backward_by_length(model, ids, labels, lengths, pick)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    attention = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    want = model(input_ids=ids[pick], attention_mask=attention[pick], labels=labels[pick]).loss
    want.backward()
    assert abs(loss - want.item()) <= 1e-5
    for got, p in zip(grads, model.parameters(), strict=True):
        assert (got - p.grad).abs().max() <= 1e-5
