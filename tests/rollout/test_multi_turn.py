"""Multi-turn rollouts and training with real vLLM on CPU, in one launch (torchrun, 2 ranks:
Megatron actor TP 2 + colocated vLLM TP 2; ``_multi_turn_launch.py``): a tiny Qwen2 warm-started
to call tools runs the loop, a trainer step and a resumed step. The tests check its records
against independent references: the chat template's own rendering of each conversation, the
assistant spans of that rendering, transformers' log-probs, a token-level parse of the
conversation's own ids, and the same step run without interruption. A second launch on its files
(``_multi_turn_launch.py OUT split``: 1 training rank, 1 vLLM rank running the whole loop one
step ahead) must give the colocated step's trajectories."""

from __future__ import annotations

import importlib.util
import json
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
WORKER = Path(__file__).with_name("_multi_turn_launch.py")
LOGPROB_TOL = 1e-4
EOT = 3  # <|im_end|> of the tiny tokenizer


def _launch(out: Path, *args: str, log_name: str, done: str, what: str) -> None:
    """``_multi_turn_launch.py OUT ARGS`` on 2 ranks, its output in ``out/log_name``; the test
    fails with the log's tail unless it exits 0 and wrote ``out/done``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
        "TORCHDYNAMO_DISABLE": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(WORKER), str(out), *args]  # fmt: skip
    log = out / log_name
    with log.open("w") as f:
        rc = subprocess.run(
            cmd, check=False, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900
        ).returncode
    if rc != 0 or not (out / done).exists():
        tail = "\n".join(log.read_text().splitlines()[-60:])
        pytest.fail(f"{what} failed (rc={rc}):\n{tail}")


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("multi_turn")
    _launch(out, log_name="worker.log", done="resume.pt", what="multi-turn launch")
    return out


@pytest.fixture(scope="module")
def record(launch) -> dict:
    rec = json.loads((launch / "record.json").read_text())
    rec["model"] = launch / "tiny"
    return rec


@pytest.fixture(scope="module")
def step(launch) -> dict:
    record = torch.load(launch / "step.pt", weights_only=False)
    record["model"] = launch / "tiny"
    return record


@pytest.fixture(scope="module")
def resumed(launch) -> dict:
    return torch.load(launch / "resume.pt", weights_only=False)


@pytest.fixture(scope="module")
def split(launch) -> list[dict]:
    """The split launch's steps 1 and 2 (on the colocated launch's model and data)."""
    _launch(launch, "split", log_name="split.log", done="split.pt", what="split multi-turn launch")
    records = torch.load(launch / "split.pt", weights_only=False)
    for r in records:
        r["model"] = launch / "tiny"
    return records


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


def test_the_reward_function_gets_verls_multi_turn_extra_info(step):
    """The scorer's ``extra_info`` holds the prompt's fields and what verl's reward managers add
    for an agent loop's response: ``num_turns``, ``tool_rewards`` (one per executed call, the
    calculator's 0.0 and 0.0 for a raising or timed-out call; none for the malformed one, no call
    in verl), ``turn_scores`` (no interaction: none) and ``rollout_reward_scores`` ({})."""
    m, mt = step["metrics"], step["multi_turn"]
    assert m["reward/mt/num_turns/mean"] == pytest.approx(mt["multi_turn/num_turns/mean"])
    # add: 2 calls, boom 1, wait 1, oops 0 (malformed); n = 2 of each
    assert m["reward/mt/tool_rewards/mean"] == pytest.approx(1.0)
    assert m["reward/mt/turn_scores/mean"] == 0.0
    assert m["reward/mt/no_rollout_reward_scores/mean"] == 1.0
    assert m["reward/mt/index_kept/mean"] == 1.0


TIMING = ("timing_s/", "timing_per_token_ms/", "perf/", "multi_turn/tool_seconds/")
"""Wall-clock metrics: the only ones a resumed step may differ in."""


def test_a_step_resumed_from_a_checkpoint_equals_the_uninterrupted_one(resumed):
    """Step 2 after loading step 1's checkpoint (weights, optimizer, sampler, KL state; the
    engine synced from it) equals step 2 run straight after step 1, bit for bit: its prompts,
    rollouts (multi-turn trajectories, masks, vLLM's log-probs), advantages, every metric but
    the clocks, and the weights after the update."""
    first, second = resumed["runs"]
    assert first["prompts"] == second["prompts"]
    for name, tensor in first["batch"].items():
        assert torch.equal(tensor, second["batch"][name]), name
    keys = [k for k in first["metrics"] if not k.startswith(TIMING)]
    assert "multi_turn/tool_calls/total" in keys and "actor/pg_loss" in keys
    different = {
        k: (first["metrics"][k], second["metrics"].get(k))
        for k in keys
        if first["metrics"][k] != second["metrics"].get(k)
    }
    assert not different
    assert resumed["weight_diff_max"] == 0.0
    assert float(first["batch"]["advantages"].abs().sum()) > 0  # the step did learn something


def test_vllm_on_a_rank_of_its_own_gives_the_colocated_trajectories(step, split):
    """Split launch, step 1 (the rollout rank ran the loop, tools included, with the weights the
    colocated step 1 had): the same prompts, token ids, per-token masks, scores (tool rewards in
    ``extra_info`` included), advantages and multi-turn metrics as the colocated run (vLLM TP 2
    there, TP 1 here: log-probs within 1e-4); the actor's log-probs equal vLLM's on its model
    tokens within 1e-4."""
    one = split[0]
    assert one["raw_prompts"] == step["raw_prompts"]
    for name in ("input_ids", "response_mask", "scores", "prompt_lengths", "lengths"):
        assert torch.equal(one[name], step[name]), name
    for name in ("rollout_log_probs", "old_log_probs", "advantages"):
        assert float((one[name] - step[name]).abs().max()) <= LOGPROB_TOL, name
    clocks = "multi_turn/tool_seconds/"
    assert {k: v for k, v in one["multi_turn"].items() if not k.startswith(clocks)} == {
        k: v for k, v in step["multi_turn"].items() if not k.startswith(clocks)
    }
    assert one["multi_turn"]["multi_turn/tool_calls/total"] == 10.0
    for key in ("reward/mt/tool_rewards/mean", "reward/mt/num_turns/mean"):
        assert one["metrics"][key] == step["metrics"][key], key
    mask = one["response_mask"]
    assert one["metrics"]["rollout/logprob_diff_max"] <= LOGPROB_TOL
    assert float(((one["old_log_probs"] - one["rollout_log_probs"]).abs() * mask).max()) <= 1e-4
    assert one["version"] == (0, 1)  # generated with the first sync's weights, then updated


def test_vllm_on_a_rank_of_its_own_runs_the_next_step_ahead_on_the_model_tokens(split):
    """Split launch, step 2: its trajectories were asked for as soon as step 1's were in and
    generated with the weights step 1 started from (version 0; the trainer holds 2 after it); the
    mask covers exactly each row's model tokens, the tool calls went on, and the update gives
    advantage to model tokens only."""
    from transformers import AutoTokenizer

    two = split[1]
    assert two["version"] == (0, 2)
    assert two["metrics"]["async/staleness_max"] == 1.0
    tokenizer = AutoTokenizer.from_pretrained(str(two["model"]))
    mask, adv = two["response_mask"], two["advantages"]
    for row in range(mask.shape[0]):
        p, n = int(two["prompt_lengths"][row]), int(two["lengths"][row])
        want = _model_positions(tokenizer, two["input_ids"][row, p:n].tolist())
        assert mask[row, : n - p].tolist() == [float(m) for m in want]
        assert float(mask[row, n - p :].abs().sum()) == 0.0
    assert two["multi_turn"]["multi_turn/tool_calls/total"] > 0
    assert two["multi_turn"]["multi_turn/tokenization_mismatches"] == 0.0
    assert float((adv * (1 - mask)).abs().sum()) == 0.0 and float((adv * mask).abs().sum()) > 0
