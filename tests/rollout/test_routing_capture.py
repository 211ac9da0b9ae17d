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


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("capture")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(WORKER), str(out), *FAMILIES],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_routing_is_the_routers_choice_for_every_token(captured, family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(captured / family, dtype=torch.float32)
    k = model.config.num_experts_per_tok
    samples = torch.load(captured / f"{family}.pt", weights_only=False)
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
