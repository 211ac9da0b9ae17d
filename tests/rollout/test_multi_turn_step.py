"""A trainer step on multi-turn rollouts (torchrun, 2 ranks: Megatron actor TP 2 + colocated vLLM TP 2;
``_multi_turn_step_worker.py``, ~55 s): tools from a verl-style tool config, the step's batch
and metrics checked against a token-level parse of the conversation's own ids."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.multirank,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed"),
]

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_multi_turn_step_worker.py")


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("multi_turn_step")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
        "TORCHDYNAMO_DISABLE": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(WORKER), str(out)]  # fmt: skip
    log = out / "worker.log"
    with log.open("w") as f:
        rc = subprocess.run(
            cmd, check=False, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600
        ).returncode
    if rc != 0 or not (out / "step.pt").exists():
        tail = "\n".join(log.read_text().splitlines()[-60:])
        pytest.fail(f"multi-turn step worker failed (rc={rc}):\n{tail}")
    record = torch.load(out / "step.pt", weights_only=False)
    record["model"] = out / "tiny"
    return record


def _model_positions(tokenizer, response: list[int]) -> list[int]:
    """1/0 per response token from the ids alone: the model writes from the response's start
    to its end-of-turn token, and again after each ``<|im_start|>assistant\\n`` header."""
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out, model = [], True
    for k, tok in enumerate(response):
        out.append(int(model))
        if model and tok == eot:
            model = False
        elif not model and response[max(0, k + 1 - len(header)) : k + 1] == header:
            model = True
    return out


def test_actor_log_probs_equal_vllm_on_model_tokens(step):
    """After the first sync the actor's recomputed log-probs equal vLLM's on every model token
    within 1e-4 (the step's consistency metric, over model tokens only); tool tokens carry none."""
    mask = step["response_mask"]
    assert step["metrics"]["rollout/logprob_diff_max"] <= 1e-4
    diff = (step["old_log_probs"] - step["rollout_log_probs"]).abs() * mask
    assert float(diff.max()) <= 1e-4
    assert float((step["rollout_log_probs"] * (1 - mask)).abs().max()) == 0.0
    # without the mask, tool tokens would be compared too: the actor's log-probs there are not 0
    assert float((step["old_log_probs"] * (1 - mask)).abs().max()) > 1.0


def test_response_mask_is_the_model_tokens_of_each_row(step):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(step["model"]))
    mask = step["response_mask"]
    for row in range(mask.shape[0]):
        p, n = int(step["prompt_lengths"][row]), int(step["lengths"][row])
        response = step["input_ids"][row, p:n].tolist()
        want = _model_positions(tokenizer, response)
        assert mask[row, : n - p].tolist() == [float(m) for m in want]
        assert float(mask[row, n - p :].abs().sum()) == 0.0
        assert 0 < sum(want) < len(want)


def test_tool_tokens_get_no_advantage_and_the_score_sits_on_the_last_model_token(step):
    """REINFORCE++ advantages are 0 on tool tokens (so the policy loss has nothing there); the
    reward (the answer 84 in the response) sits on each response's last token, a model token."""
    mask, adv, scores = step["response_mask"], step["advantages"], step["scores"]
    assert float((adv * (1 - mask)).abs().sum()) == 0.0
    assert float((adv * mask).abs().sum()) > 0.0
    lengths = step["lengths"] - step["prompt_lengths"]
    for row in range(mask.shape[0]):
        last = int(lengths[row]) - 1
        assert mask[row, last] == 1.0
        assert scores[row].nonzero().flatten().tolist() in ([], [last])
    add = [i for i, p in enumerate(step["raw_prompts"]) if p[0]["content"].startswith("add")]
    rows = [2 * i + s for i in add for s in range(2)]
    assert [float(scores[r].sum()) for r in rows] == [1.0, 1.0]


def test_multi_turn_metrics(step):
    m = step["multi_turn"]
    assert m["multi_turn/tool_calls/total"] == 10.0  # add: 2 each, the others 1 each, n = 2
    assert [m[f"multi_turn/tool_errors/{k}"] for k in ("raised", "timeout", "malformed")] == [
        2.0, 2.0, 2.0,
    ]  # fmt: skip
    assert m["multi_turn/num_turns/max"] == 6.0
    assert m["multi_turn/tokenization_mismatches"] == 0.0
