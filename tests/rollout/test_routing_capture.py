"""The rollout's MoE routing captured inside vLLM's worker (:mod:`megarl.rollout.routing_capture`)
equals, token by token, the experts transformers' routers choose for the same sequences."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_routing_capture_worker.py")
FAMILIES = ["qwen3_moe", "mixtral"]
pytestmark = [pytest.mark.vllm]


def _capture(out: Path, **env_extra: str) -> Path:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env_extra}  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(WORKER), str(out), *FAMILIES],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Path:
    return _capture(tmp_path_factory.mktemp("capture"))


def _check_against_transformers(captured: Path, family: str, source: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(captured / family, dtype=torch.float32)
    k = model.config.num_experts_per_tok
    result = torch.load(captured / f"{family}.pt", weights_only=False)
    assert result["source"] == source
    assert result["update_in_place"] is False  # experts are repacked after a load
    samples = result["samples"]
    assert len(samples) == 8
    compared = 0
    for sample in samples:
        ids = sample["prompt"] + sample["response"]
        routing = torch.from_numpy(sample["routing"]).long()  # [positions, layers, k]
        assert routing.shape == (len(ids), model.config.num_hidden_layers, k)
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            expected = logits.reshape(len(ids), -1).topk(k, dim=-1).indices.sort(-1).values
            got = routing[:, layer].sort(-1).values
            # Every position vLLM ran (all but the last generated token) holds its choice.
            assert torch.equal(got[:-1], expected[:-1]), (layer, got[:-1], expected[:-1])
            assert (routing[-1, layer] == -1).all()  # sampled, never run through the model
            compared += len(ids) - 1
    assert compared > 8 * 3 * 10


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_routing_is_the_routers_choice_for_every_token(captured, family):
    """The hooks' capture (the CPU source; on GPU with vLLM's V1 runner, eager)."""
    _check_against_transformers(captured, family, "hooks")


@pytest.mark.gpu
def test_vllms_own_routed_experts_are_the_routers_choice_for_every_token(tmp_path_factory):
    """The GPU source: vLLM's aux output under its Model Runner V2 (CUDA graphs and prefix
    caching allowed), converted to the same format, equals transformers' routers too."""
    out = _capture(tmp_path_factory.mktemp("capture_aux"), VLLM_USE_V2_MODEL_RUNNER="1")
    for family in FAMILIES:
        _check_against_transformers(out, family, "aux")


def test_vllms_routed_experts_convert_to_the_capture_format():
    """``CompletionOutput.routed_experts`` ([prompt + generated - 1, layers, k], uint8) gains
    the last position as -1; a row count that does not fit the sequence is refused."""
    import numpy as np

    from megarl.rollout.routing_capture import from_routed_experts

    routed = np.arange(5 * 3 * 2, dtype=np.uint8).reshape(5, 3, 2)
    got = from_routed_experts(routed, 6)
    assert got.dtype == np.int16 and got.shape == (6, 3, 2)
    assert (got[:5] == routed).all() and (got[5] == -1).all()
    with pytest.raises(RuntimeError, match=r"expected \[6, layers, k\]"):
        from_routed_experts(routed, 7)
    with pytest.raises(RuntimeError, match="no routed experts"):
        from_routed_experts(None, 6)
