"""Routing replay R3 through the trainer's own calls (``tests/trainer/_replay_worker.py``): the
actor replays the routing vLLM chose, so where the actor's routers would choose differently its
log-probs still match the rollout's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_replay_worker.py")
MEG = "actor_rollout_ref.actor.megatron"
SCALE = 0.01
"""Router noise, in units of each router weight's std. Measured: 1 % of the tokens' choices
re-routed (agreement 0.990); the largest log-prob gap to vLLM 1.22 routing afresh, 0.039
replaying (the gating weights' own change). At 0.05: 0.94, 2.10 and 0.19. With the replayed
layers mixed up on purpose (reversed) every check here fails (agreement 0.04, gap 5.7)."""
pytestmark = [pytest.mark.vllm, pytest.mark.multirank]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    from megarl.commands import data
    from megarl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("r3")
    make_tiny_model(tmp / "model", "qwen3_moe", seed=0)
    assert data.main(["synth", "--out", str(tmp / "data"), "--train-size", "64"]) == 0
    spec = {
        "config": str(REPO / "configs" / "grpo_moe_tiny_cpu.yaml"),
        "overrides": [
            f"actor_rollout_ref.model.path={tmp / 'model'}",
            f"data.train_files={tmp / 'data' / 'train.parquet'}",
            f"data.val_files={tmp / 'data' / 'test.parquet'}",
            f"{MEG}.router_replay.mode=R3",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            "actor_rollout_ref.actor.use_kl_loss=true",  # a reference pass (routing afresh)
            "trainer.val_before_train=false",
            "actor_rollout_ref.rollout.max_model_len=384",  # the multi-turn case's turns
        ],
        "tmp": str(tmp),
        "scale": SCALE,
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    run_torchrun(WORKER, 2, [str(tmp / "spec.json")], timeout=900)
    return torch.load(tmp / "replay.pt", weights_only=False)


def test_with_the_synced_weights_trainer_and_vllm_route_alike(measured):
    synced = measured["synced"]
    print(synced)
    assert synced["agreement"] >= 0.999
    assert synced["replayed"] <= 1e-4 and synced["free"] <= 1e-4


def test_replay_keeps_the_rollouts_routing_when_the_routers_differ(measured):
    """Perturbed routers send some tokens elsewhere (agreement < 1): routing afresh, the log-probs
    move far from vLLM's; replaying vLLM's routing, only the gating weights' small change is
    left."""
    perturbed = measured["perturbed"]
    print(perturbed)
    assert perturbed["agreement"] < 0.999
    assert perturbed["free"] > 10 * perturbed["replayed"], perturbed


def test_multi_turn_rollouts_replay_each_tokens_own_routing(measured):
    """Multi-turn trajectories (model turns, user turns from verl's GSM8K interaction): the
    routing of each position comes from the request that first ran it (a model token's from its
    own turn); replayed, the actor's log-probs equal vLLM's on every model token, and with
    perturbed routers replay keeps them close where routing afresh moves them far."""
    rollout, synced, perturbed = (measured[k] for k in ("mt_rollout", "mt_synced", "mt_perturbed"))
    print(rollout, synced, perturbed)
    assert rollout["multi_turn/assistant_turns/mean"] > 1.5
    assert rollout["user_tokens"] > 0 and rollout["model_tokens"] > 0
    assert synced["agreement"] >= 0.999
    assert synced["replayed"] <= 1e-4
    assert perturbed["agreement"] < 0.999
    assert perturbed["free"] > 10 * perturbed["replayed"], perturbed


def test_a_training_step_replays_in_every_pass(measured):
    m = measured["step"]
    assert m["rollout_corr/router_agreement"] >= 0.999  # old log-probs: vLLM's routing
    assert 0.5 < m["actor/router_agreement"] <= 1.0  # the update's forwards
    assert m["rollout/logprob_diff_max"] <= 1e-4
    assert torch.isfinite(torch.tensor(m["actor/kl_loss"]))


def test_the_step_reports_the_expert_load_the_update_routed(measured):
    """``actor/expert_load_*`` (hooks on the routers during the update) equals the load counted
    from the rollout routing the update replayed, independently, in the worker."""
    m, expected = measured["step"], measured["expected_load"]
    print({k: v for k, v in m.items() if "expert_load" in k}, expected)
    assert m["actor/expert_load_imbalance"] == pytest.approx(expected["mean"], rel=1e-9)
    assert m["actor/expert_load_imbalance_max"] == pytest.approx(expected["max"], rel=1e-9)
    assert m["actor/expert_load_worst_layer"] == expected["layer"]
    assert 1.0 < expected["mean"] < 4.0  # uneven; 4 = E / k: every token on the same k


def test_a_response_without_its_routing_stops_the_step():
    """R3 cannot replay a response whose routing the engine did not return (it would go to
    experts 0..k-1 with agreement 0): the step fails in one line naming it."""
    from megarl.rollout.base import RolloutBatch, RolloutSample
    from megarl.trainer.passes import captured_routing

    def sample(i: int, routing) -> RolloutSample:
        return RolloutSample(i, 0, [1, 2], [3], [-0.5], "stop", prompt_id=i, routing=routing)

    routed = torch.zeros(3, 2, 2, dtype=torch.int16)
    assert captured_routing(RolloutBatch([sample(0, None), sample(1, None)]), 3) is None
    full = captured_routing(RolloutBatch([sample(0, routed), sample(1, routed)]), 3)
    assert full.shape == (2, 3, 2, 2)
    with pytest.raises(RuntimeError, match="no routing for response 1 \\(prompt 1\\) of 2"):
        captured_routing(RolloutBatch([sample(0, routed), sample(1, None)]), 3)
