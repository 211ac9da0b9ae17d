"""Disaggregated placement (issue 26, item 4), through the trainer's own calls
(tests/trainer/_disagg_worker.py), 2 training ranks and 2 rollout ranks: at staleness 0, two
GRPO steps of the tiny MoE (actor EP 2) replaying vLLM's routing (R3), with two vLLM replicas
(TP 1) on ranks of their own, equal the colocated run of the same config and seeds (two
colocated replicas), and so does a multi-turn batch after them (issue 43: the routing composed
on the rollout ranks comes back and is replayed); up to two steps off, with one vLLM engine of TP 2 on the rollout ranks,
three ReMax steps (step 2 one step off, step 3 two) equal a colocated run (vLLM TP 2) whose
engine gets each step's weights two steps late (actor PP 2, so the weights reach vLLM from both
pipeline stages; ReMax's greedy batch asked for ahead with its sampled one); one step off, with
vLLM TP 1 on one rollout rank loading each update straight in, the same ReMax steps equal a
colocated run whose engine is one update behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_disagg_worker.py")
MEG = "actor_rollout_ref.actor.megatron"
pytestmark = [pytest.mark.vllm, pytest.mark.multirank]


POISONED_SCORER = """
import json, os
from megarl.data.synthetic import compute_score as synthetic

def compute_score(data_source, solution_str, ground_truth, extra_info=None, poison=None, **kw):
    if os.path.exists(poison) and extra_info["index"] in json.load(open(poison)):
        raise ValueError(f"poisoned row {extra_info['index']}")
    return synthetic(solution_str, ground_truth)
"""


GSM8K_INTERACTION = """
interaction:
  - name: gsm8k
    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
    config: {}
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_overrides) -> dict:
    from megarl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("disagg")
    make_tiny_model(tmp / "moe", "qwen3_moe", seed=0)
    spec = {
        "config": str(REPO / "configs" / "grpo_tiny_cpu.yaml"),
        "overrides": [
            *tiny_overrides,
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "trainer.val_before_train=false",
        ],
        # staleness 0: the tiny MoE (actor EP 2) replaying vLLM's routing (R3), which comes back
        # from the rollout ranks with the batch
        "on_config": str(REPO / "configs" / "grpo_moe_tiny_cpu.yaml"),
        "on_overrides": [
            f"actor_rollout_ref.model.path={tmp / 'moe'}",
            f"{MEG}.router_replay.mode=R3",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            # the multi-turn batch after the steps (the worker's _multi_turn)
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp / 'gsm8k.yaml'}",
            "actor_rollout_ref.rollout.max_model_len=384",
        ],
        # up to two steps off at TP 1 x PP 2: the weights reach vLLM (TP 2) from both stages;
        # ReMax, whose greedy batch goes ahead too; the synthetic task's scorer, raising for the
        # rows of poison.json (the split run's 4th batch)
        "off_overrides": [
            "algorithm.adv_estimator=remax",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            f"custom_reward_function.path={tmp / 'scorer.py'}",
            "custom_reward_function.name=compute_score",
            f"+custom_reward_function.reward_kwargs.poison={tmp / 'poison.json'}",
        ],
        # one step off, on the path that loads each update straight into vLLM: vLLM TP 1 on one
        # rollout rank (two colocated replicas; the tokens do not depend on their number)
        "one_overrides": ["actor_rollout_ref.rollout.tensor_model_parallel_size=1"],
        "tmp": str(tmp),
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    (tmp / "scorer.py").write_text(POISONED_SCORER)
    (tmp / "gsm8k.yaml").write_text(GSM8K_INTERACTION)
    # the three colocated references in one launch of 2 ranks, one after another (each its own
    # run and engine); then each split run in a launch of its own, split_off last (it writes
    # poison.json)
    launches = [(2, ["colocated", "colocated_one", "colocated_off"]), (4, ["split"]),
                (3, ["split_one"]), (4, ["split_off"])]  # fmt: skip
    for world, modes in launches:
        run_torchrun(WORKER, world, [str(tmp / "spec.json"), *modes], timeout=900)
    return {m: torch.load(tmp / f"{m}.pt", weights_only=False) for _, ms in launches for m in ms}


def test_the_trainer_sees_its_own_world(runs):
    assert runs["colocated"]["world"] == runs["split"]["world"] == 2


def _same_run(colocated: dict, split: dict) -> None:
    """The same responses and rewards at every step, the metrics and the actor's final weights
    within float noise (vLLM batches the requests differently)."""
    for step, (a, b) in enumerate(zip(colocated["steps"], split["steps"], strict=True), start=1):
        assert a["input_ids"] == b["input_ids"], step
        assert a["rewards"] == b["rewards"], step
        # only the colocated engine sleeps (the rollout ranks' devices train nothing)
        assert set(a["metrics"]) - set(b["metrics"]) == {"rollout/sleep_level"}, step
        for key, value in a["metrics"].items():
            if key.startswith(("timing", "perf", "memory", "rollout/sleep")):
                continue
            assert b["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)
    for name, w in colocated["weights"].items():
        assert torch.allclose(split["weights"][name], w, rtol=1e-4, atol=1e-6), name


def test_vllm_replicas_on_ranks_of_their_own_give_the_colocated_run(runs):
    """Two steps of the MoE with R3: the actor's old log-probs replay the routing the rollout
    ranks' vLLM chose, so they match vLLM's."""
    _same_run(runs["colocated"], runs["split"])
    assert all(
        s["metrics"]["rollout_corr/router_agreement"] >= 0.999 for s in runs["split"]["steps"]
    )
    assert all(s["metrics"]["rollout/logprob_diff_max"] <= 1e-4 for s in runs["split"]["steps"])
    assert [s["metrics"]["async/staleness_max"] for s in runs["split"]["steps"]] == [0.0, 0.0]


def test_multi_turn_routing_composed_on_the_rollout_ranks_is_replayed(runs):
    """Issue 43 with R3 and vLLM on ranks of its own: the rollout ranks run the whole
    multi-turn loop (3 model turns, verl's GSM8K interaction answering), composing each
    trajectory's routing from its turns' requests (a model token's from its own turn); it
    comes back with the trajectories and the actor's old log-probs replaying it equal vLLM's
    on every model token. The same trajectories, routing and log-probs as the colocated run."""
    co, split = runs["colocated"]["multi_turn"], runs["split"]["multi_turn"]
    print({k: v for k, v in split.items() if isinstance(v, float)})
    assert split["multi_turn/assistant_turns/mean"] > 2.5
    assert split["user_tokens"] > 0 and split["model_tokens"] > 0
    assert split["agreement"] >= 0.999
    assert split["gap"] <= 1e-4
    assert split["input_ids"] == co["input_ids"]
    assert split["response_mask"] == co["response_mask"]
    assert torch.equal(split["routing"], co["routing"])
    mask = torch.tensor(co["response_mask"]).bool()
    for key in ("rollout_log_probs", "old_log_probs"):
        assert torch.allclose(split[key][mask], co[key][mask], atol=1e-5), key


def test_bounded_staleness_trains_on_the_rollouts_of_older_weights(runs):
    """Batches 2 and 3 (and ReMax's greedy ones) asked for by step 1, batch 4 by step 2, each
    generated while earlier steps trained, with the weights the trainer held when asking (the
    weight updates streaming to the rollout ranks meanwhile): step 2 trains one step off, step
    3 two, the same run as the colocated one whose engine is always two updates behind."""
    _same_run(runs["colocated_off"], runs["split_off"])
    staleness = [s["metrics"]["async/staleness_max"] for s in runs["split_off"]["steps"]]
    assert staleness == [0.0, 1.0, 2.0]
    gaps = [s["metrics"]["rollout/logprob_diff_max"] for s in runs["split_off"]["steps"]]
    assert gaps[0] <= 1e-4 < gaps[1]  # the behaviour policy is older than the actor from step 2
    # each of the 2 rollout ranks staged what its vLLM TP rank loads (about half, the norms
    # whole on both; in place, or vLLM would read NaN); together a little over the model
    whole = sum(w.numel() * w.element_size() for w in runs["split_off"]["weights"].values())
    for s in runs["split_off"]["steps"]:
        assert whole < s["metrics"]["async/update_weights_bytes"] < 1.05 * whole


def test_one_step_off_trains_on_the_rollouts_of_the_weights_before_the_last_update(runs):
    """At most one step off the rollout rank loads each update straight into vLLM when it
    reaches its command (no staging): batch k comes from the weights after update k-2, the same
    run as the colocated one whose engine is always one update behind."""
    _same_run(runs["colocated_one"], runs["split_one"])
    staleness = [s["metrics"]["async/staleness_max"] for s in runs["split_one"]["steps"]]
    assert staleness == [0.0, 1.0, 1.0]
    gaps = [s["metrics"]["rollout/logprob_diff_max"] for s in runs["split_one"]["steps"]]
    assert gaps[0] <= 1e-4 < gaps[1]
    # batches 2 and 3 were taken in by the syncs before them (the wait is the sync's), so the
    # rollout rank was idle when the bytes went (as NCCL needs, where the GPUs are the ranks' own)
    assert [s["metrics"]["async/wait_rollout_s"] for s in runs["split_one"]["steps"][1:]] == [0, 0]
    assert all("async/sync_wait_rollout_s" in s["metrics"] for s in runs["split_one"]["steps"])
    # the whole model once (fp32), to the one rollout rank
    whole = sum(w.numel() * w.element_size() for w in runs["split_one"]["weights"].values())
    sent = {s["metrics"]["async/update_weights_bytes"] for s in runs["split_one"]["steps"]}
    assert sent == {whole}, (sent, whole)


def test_the_training_ranks_hold_what_the_planner_declares(runs):
    """No engine on the training devices in any phase (megarl plan sums the same schedule:
    tests/planner/test_memory_plan.py), the models where the colocated run has them."""
    for mode in ("split", "split_one", "split_off"):
        log = runs[mode]["residency"]
        assert [phase for phase, _, _ in log][:3] == ["setup", "sync", "generate"]
        for phase, applied, declared in log:
            assert applied == declared and applied.engine is None, (mode, phase, applied)
    colocated = [applied.models for _, applied, _ in runs["colocated_off"]["residency"]]
    assert [applied.models for _, applied, _ in runs["split_off"]["residency"]] == colocated


def test_a_scorer_error_on_the_rollout_rank_is_raised_on_the_trainer_in_one_line(runs):
    """Batch 4, asked for ahead by step 2, was scored on the rollout ranks, whose scorer raised:
    step 4 raises the reward error on the trainer, one line naming the scorer's error (not a
    hang, not the rollout rank's traceback)."""
    error = runs["split_off"]["scorer_error"]
    assert error.startswith("scorer compute_score from "), error  # the colocated run's words
    assert "ValueError: poisoned row" in error and "\n" not in error, error
