"""Disaggregated placement (issue 26, item 2): one launch split into 2 training ranks and a vLLM
engine on a rank of its own; the actor's weights travel to it over a process group by the
resharding plan (tests/rollout/_remote_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_torchrun

WORKER = Path(__file__).with_name("_remote_worker.py")
pytestmark = [pytest.mark.vllm, pytest.mark.multirank]


@pytest.fixture(scope="module")
def remote(tmp_path_factory) -> dict:
    from megarl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("remote")
    model = make_tiny_model(tmp / "model", "qwen2", num_key_value_heads=2, seed=0)
    run_torchrun(WORKER, 3, [str(model), str(tmp)], timeout=900)
    return json.loads((tmp / "remote.json").read_text())


def test_each_side_has_its_own_world(remote):
    assert remote["ranks"] == [0, "train", 2]


@pytest.mark.parametrize("layout", ["tp2_pp1", "tp1_pp2"])
def test_vllm_on_its_own_rank_follows_the_actor_after_a_remote_sync(remote, layout):
    """Before the sync vLLM's log-probs are the old weights'; after it they equal the actor's
    (1e-4, fp32); the rollout rank received exactly the plan's HF tensors."""
    r = remote[layout]
    print(layout, r["before"], r["after"])
    assert r["before"]["rollout/logprob_diff_mean"] > 1e-2
    assert r["after"]["rollout/logprob_diff_max"] <= 1e-4
    assert r["received"] == r["planned_bytes"] and r["sent_buckets"] > 3
