"""vLLM adapter pieces without starting vLLM: EOS ids (config, tokenizer fallback, refusal), log-probs."""

from __future__ import annotations

import json

import pytest

from megarl.rollout.vllm_engine import resolve_eos_token_ids


def _config_only(directory, **fields):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", **fields}))
    return directory


def test_checkpoint_eos_ids_come_first(tmp_path):
    model = _config_only(tmp_path / "m", eos_token_id=[7, 5])
    assert resolve_eos_token_ids(model) == [7, 5]
    assert resolve_eos_token_ids(model, eos_token_ids=[3]) == [3]


def test_tokenizer_eos_is_the_fallback(tmp_path):
    from megarl.models.tiny import EOS_TOKEN, SPECIAL_TOKENS, build_tokenizer

    model = _config_only(tmp_path / "m")  # no eos_token_id anywhere in the checkpoint
    build_tokenizer(300).save_pretrained(str(tmp_path / "tok"))
    assert resolve_eos_token_ids(model, tmp_path / "tok") == [SPECIAL_TOKENS.index(EOS_TOKEN)]


def test_no_eos_at_all_refuses_to_start(tmp_path):
    model = _config_only(tmp_path / "m")
    with pytest.raises(ValueError, match="no EOS token id") as info:
        resolve_eos_token_ids(model)
    assert "\n" not in str(info.value)


def test_flat_logprobs_read_as_the_per_token_dicts():
    """flat_logprobs=True changes vLLM's container, not the numbers megarl reads from it."""
    logprobs_module = pytest.importorskip("vllm.logprobs")
    from megarl.rollout.vllm_outputs import sampled_logprobs

    tokens = [5, 9, 2]
    # logprobs=0 in processed mode: the sampled token first, then (here) an extra top entry
    steps = [
        {5: logprobs_module.Logprob(-0.5, 1)},
        {9: logprobs_module.Logprob(-1.25, 2), 4: logprobs_module.Logprob(-0.75, 1)},
        {2: logprobs_module.Logprob(-3.0, 7)},
    ]
    flat = logprobs_module.FlatLogprobs()
    flat.extend(steps)
    assert sampled_logprobs(tokens, flat) == sampled_logprobs(tokens, steps) == [-0.5, -1.25, -3.0]
    with pytest.raises(RuntimeError, match="sampled tokens"):
        sampled_logprobs([5, 4, 2], flat)
