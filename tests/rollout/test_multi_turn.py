"""Multi-turn rollouts with real vLLM on CPU: a tiny Qwen2 warm-started to call tools
(``_multi_turn_worker.py``, one process, ~40 s) runs the loop; the tests check its records
against independent references: the chat template's own rendering of each conversation, the
assistant spans of that rendering, and transformers' log-probs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed"),
]

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_multi_turn_worker.py")
LOGPROB_TOL = 1e-4
EOT = 3  # <|im_end|> of the tiny tokenizer


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("multi_turn")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
        "TORCHDYNAMO_DISABLE": "1",
    }
    log = out / "worker.log"
    with log.open("w") as f:
        rc = subprocess.run(
            [sys.executable, str(WORKER), f"--out={out}"], check=False, env=env, stdout=f,
            stderr=subprocess.STDOUT, timeout=600,
        ).returncode  # fmt: skip
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-60:])
        pytest.fail(f"multi-turn worker failed (rc={rc}):\n{tail}")
    rec = json.loads((out / "record.json").read_text())
    rec["model"] = out / "tiny"
    return rec


@pytest.fixture(scope="module")
def tokenizer(record):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(record["model"]))


def _by_prompt(record, index: int) -> list[dict]:
    return [t for t in record["trajectories"] if t["prompt_index"] == index]


def test_the_model_calls_the_calculator_twice_and_answers(record):
    """Prompt 0: two successful calculator calls whose answers the model reads, then an answer
    without a call (the trajectory ends there, not at a limit)."""
    for t in _by_prompt(record, 0):
        assert t["errors"] == ["none", "none"]
        assert t["tool_texts"] == ["42", "84"]
        assert (t["assistant_turns"], t["user_turns"]) == (3, 2)
        assert [m["role"] for m in t["messages"]] == [
            "user", "assistant", "tool", "assistant", "tool", "assistant",
        ]  # fmt: skip
        assert "<tool_call>" not in t["messages"][-1]["content"]
    assert record["metrics"]["multi_turn/tool_calls/total"] == 20.0
    assert record["metrics"]["multi_turn/num_turns/max"] == 6.0


def test_a_raising_a_hanging_and_a_malformed_call_each_become_an_error_turn(record):
    """The tool turn carries the error, and the model takes one more turn after it."""
    expect = {1: ("raised", "boom"), 2: ("timeout", "timed out after 0.5 s"),
              3: ("malformed", "Malformed tool call")}  # fmt: skip
    for index, (kind, text) in expect.items():
        for t in _by_prompt(record, index):
            assert t["errors"] == [kind]
            assert text in t["tool_texts"][0]
            assert t["messages"][2] == {"role": "tool", "content": t["tool_texts"][0]}
            assert t["assistant_turns"] == 2 and t["messages"][-1]["role"] == "assistant"
    metrics = record["metrics"]
    assert [metrics[f"multi_turn/tool_errors/{k}"] for k in ("raised", "timeout", "malformed")] == [
        4.0, 4.0, 4.0,
    ]  # fmt: skip


def test_ids_are_the_turns_concatenation_without_drift(record, tokenizer):
    """prompt + response ids are the start of the whole conversation as the chat template
    renders it (the template only closes the last turn after them): no turn was re-tokenised
    differently, and the loop's own sanity check agrees on every trajectory."""
    from megarl.tools.warm_start import assistant_token_mask

    for t in record["trajectories"]:
        rendered, _ = assistant_token_mask(tokenizer, t["messages"], EOT)
        held = t["prompt_ids"] + t["response_ids"]
        assert rendered[: len(held)] == held
        assert tokenizer.decode(rendered[len(held) :]) == "\n"
        assert t["tokenization_ok"] is True and t["drifted_turns"] == 0
    assert record["metrics"]["multi_turn/tokenization_mismatches"] == 0.0


def test_response_mask_is_exactly_the_model_tokens(record, tokenizer):
    """The loop's mask and the trainer batch's ``response_mask`` are 1 exactly on the assistant
    turns' tokens (their end-of-turn token included) of the rendered conversation, 0 on tool
    turns (and on the template's text around them), 0 past the response."""
    from megarl.tools.warm_start import assistant_token_mask

    for t in record["trajectories"]:
        _, spans = assistant_token_mask(tokenizer, t["messages"], EOT)
        p, r = len(t["prompt_ids"]), len(t["response_ids"])
        want = spans[p : p + r]
        assert t["mask"] == want
        assert t["batch_mask"] == [float(m) for m in want]
        assert set(t["batch_mask_tail"]) <= {0.0}
        assert 0 < sum(want) < r  # both kinds of tokens are there


def test_vllm_log_probs_equal_transformers_on_model_tokens(record):
    """vLLM's log-probs of the sampled tokens equal transformers' (fp32) within 1e-4 at every
    model token, in every turn; tool tokens carry 0 in the trajectory and in the batch."""
    for t in record["trajectories"]:
        for lp, ref, m, in_batch in zip(
            t["logprobs"], t["hf_logprobs"], t["mask"], t["batch_logprobs"], strict=True
        ):
            if m:
                assert abs(lp - ref) <= LOGPROB_TOL
                assert in_batch == pytest.approx(lp, abs=1e-6)
            else:
                assert lp == 0.0 and in_batch == 0.0
        # The reference tells tokens apart: transformers' log-probs of the tool turns' tokens,
        # which the model was never taught, are far from 0 (a shifted position would show).
        assert min(r for r, m in zip(t["hf_logprobs"], t["mask"]) if not m) < -1.0
