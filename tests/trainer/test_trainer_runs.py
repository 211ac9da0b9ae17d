"""Short trainer runs (actor engine, no vLLM), one launch per world size for all of them.

- every registered advantage estimator runs two steps at DP=2 and at DP=1, and its advantages at
  DP=2 equal those at DP=1 (the global batch makes them layout-independent); gae with a critic
  also for values and returns;
- KL in the reward equals score - beta·KL by hand; the adaptive controller follows verl's rule;
  ReMax's baseline is the score of a greedy sample generated and scored here;
- DP replicas hold bit-identical weights after two steps at DP=2;
- a NaN injected into one rank's loss skips the step on every rank, leaves the weights
  unchanged, is counted, and the run continues;
- offloading gradient buffers and optimizer state between steps changes nothing;
- a learned reward model with its own chat template scores every response (its scores reach
  ``critic/score/*`` and the token-level rewards) as transformers does on the decoded responses.
- PPO on the synthetic task (configs/ppo_tiny_cpu.yaml, 20 steps): the critic's explained
  variance rises to a measured level and greedy validation does not fall.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from megarl.algo import ADV_ESTIMATORS
from tests.conftest import run_torchrun

WORKER = Path(__file__).with_name("_runs_worker.py")
pytestmark = pytest.mark.multirank

# Every registered estimator (the registry is the list); gae, which needs a critic, has its own
# test below.
ESTIMATORS = sorted(set(ADV_ESTIMATORS.names()) - {"gae"})
OVERRIDES = [
    "actor_rollout_ref.rollout.name=actor",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "data.train_batch_size=4",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
]

PPO_LEARNING = [
    "data.train_batch_size=8",  # x rollout.n 4 = 32 responses a step
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "data.val_max_samples=64",
    "trainer.val_before_train=true",  # loads the validation set
]
"""configs/ppo_tiny_cpu.yaml (GAE with a critic, KL in the reward, actor and critic at PP 2) with
this launch's rollout (the actor as engine), 8 prompts x 4 responses of 8 tokens a step."""
PPO_STEPS = 20
EXPLAINED_VAR_FLOOR = -0.5
VALIDATION_GAIN = 0.2
"""See test_ppo_learns_on_the_synthetic_task (measured gains 0.42 to 0.47)."""


ALL_OFFLOADS = [
    *(f"{m}.megatron.{k}_offload=true" for m in ("actor_rollout_ref.actor", "critic")
      for k in ("param", "grad", "optimizer")),
    "actor_rollout_ref.ref.megatron.param_offload=true",
]  # fmt: skip


GDPO_SCORER = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
    "    return {'score': 0.1 + (len(solution_str) % 7) / 10,\n"
    "            'length': (len(solution_str) % 5) / 4,\n"
    "            'digits': float(sum(c.isdigit() for c in solution_str) % 3)}\n"
)
"""GDPO's reward components come from the function's dict (verl: its non_tensor_batch)."""


def _estimator_overrides(name: str, tmp: Path) -> list[str]:
    extra = [f"algorithm.adv_estimator={name}"]
    if name.endswith("optimal_token_baseline"):
        extra.append("actor_rollout_ref.actor.calculate_sum_pi_squared=true")
    if name == "gdpo":
        (tmp / "gdpo_reward.py").write_text(GDPO_SCORER)
        extra += [f"custom_reward_function.path={tmp / 'gdpo_reward.py'}",
                  "algorithm.gdpo_reward_keys=[length,digits]",
                  "algorithm.gdpo_reward_weights=[1.0,0.5]"]  # fmt: skip
    return extra


RM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{% endif %}{% endfor %}"
)
"""The reward model's chat template (the actor's is ChatML)."""


def _reward_model_run(tmp: Path) -> dict:
    """Two GRPO steps scored by a tiny random Llama reward model with its own chat template."""
    from megarl.models.tiny import make_tiny_reward_model

    make_tiny_reward_model(tmp / "rm", "llama", seed=9, chat_template=RM_TEMPLATE)
    overrides = ["reward_model.enable=true", f"reward_model.model.path={tmp / 'rm'}",
                 "reward_model.micro_batch_size_per_gpu=3"]  # fmt: skip
    return {"name": "reward_model", "overrides": overrides, "steps": 2, "worlds": [2]}


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> dict:
    from megarl.commands import data
    from megarl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("runs")
    make_tiny_model(tmp / "model", family="qwen2", seed=3)
    assert data.main(["synth", "--out", str(tmp / "data"), "--train-size", "64"]) == 0
    runs = [
        {"name": name, "overrides": _estimator_overrides(name, tmp), "steps": 2, "worlds": [1, 2]}
        for name in ESTIMATORS
    ]
    runs.append({"name": "nan", "overrides": [], "steps": 2, "poison_step": 1, "worlds": [2]})
    # One mini-batch with IS weights on (so the old log-probs are recomputed, not shortcut): the
    # first mini-batch of the first epoch sees ratio 1.
    one_mini = ["actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "algorithm.rollout_correction.rollout_is=token"]  # fmt: skip
    runs.append({"name": "decoupled", "overrides": one_mini, "steps": 1, "worlds": [2]})
    # Bypass mode (two mini-batches, so no shortcut either): the rollout's log-probs are the old
    # ones and no old-log-prob pass runs, as in verl.
    bypass = ["algorithm.rollout_correction.bypass_mode=true"]
    runs.append({"name": "bypass", "overrides": bypass, "steps": 1, "worlds": [2]})
    runs.append({"name": "bf16_lr0", "overrides": ["trainer.dtype=bf16",
                 "actor_rollout_ref.actor.optim.lr=0"], "steps": 1, "worlds": [2]})  # fmt: skip
    runs.append({"name": "gae", "overrides": ["algorithm.adv_estimator=gae"], "steps": 2,
                 "worlds": [1, 2]})  # fmt: skip
    kl = ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl"]
    # PPO with a critic and a reference (KL in the reward): every model of the residency
    # schedule; the same with every offload on must give the same numbers.
    kl_fixed = [*kl, "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.adv_estimator=gae"]
    runs.append({"name": "kl_fixed", "overrides": kl_fixed, "steps": 2, "worlds": [2]})
    runs.append({"name": "offload", "overrides": [*kl_fixed, *ALL_OFFLOADS], "steps": 2,
                 "worlds": [2]})  # fmt: skip
    adaptive = [*kl, "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.2",
                "algorithm.kl_ctrl.target_kl=0.01", "algorithm.kl_ctrl.horizon=40"]  # fmt: skip
    runs.append({"name": "kl_adaptive", "overrides": adaptive, "steps": 5, "worlds": [2]})
    # A scorer that is non-zero for any answer (the random model's greedy answers score 0 on
    # the synthetic task), so that the baseline check compares non-zero numbers.
    scorer = tmp / "reward.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    return 0.1 + (len(solution_str) % 7) / 10\n"
    )
    remax = ["algorithm.adv_estimator=remax", f"custom_reward_function.path={scorer}"]
    runs.append({"name": "remax_greedy", "overrides": remax, "steps": 1,
                 "greedy_scores": True, "worlds": [2]})  # fmt: skip
    runs.append(_reward_model_run(tmp))
    runs.append({"name": "ppo_learning", "config": "configs/ppo_tiny_cpu.yaml",
                 "overrides": PPO_LEARNING, "steps": PPO_STEPS, "worlds": [2]})  # fmt: skip
    spec = {
        "config": "configs/grpo_tiny_cpu.yaml",
        "overrides": [
            *OVERRIDES,
            f"actor_rollout_ref.model.path={tmp / 'model'}",
            f"data.train_files={tmp / 'data' / 'train.parquet'}",
            f"data.val_files={tmp / 'data' / 'test.parquet'}",
        ],
        "runs": runs,
        "tmp": str(tmp),
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    return spec


def _results(spec: dict, world: int) -> dict:
    out = Path(spec["tmp"]) / f"runs_ws{world}.pt"
    if not out.exists():
        run_torchrun(WORKER, world, [str(Path(spec["tmp"]) / "spec.json")], timeout=1500)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def dp2(spec):
    return _results(spec, 2)


@pytest.fixture(scope="module")
def dp1(spec):
    return _results(spec, 1)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_estimator_runs_two_steps_and_is_layout_independent(dp1, dp2, estimator):
    one, two = dp1[estimator], dp2[estimator]
    for run in (one, two):
        assert len(run["steps"]) == 2
        for step in run["steps"]:
            m = step["metrics"]
            assert all(math.isfinite(m[k]) for k in ("actor/pg_loss", "actor/grad_norm")), m
            assert m["actor/skipped_steps"] == 0 and not step["weights_unchanged"]
    # Step 2's rollout is sampled from the weights step 1's update left, so equal step-2
    # rollouts and advantages at DP=1 and DP=2 check the update too, not just the estimator.
    first, second = one["steps"], two["steps"]
    assert not torch.equal(first[0]["input_ids"], first[1]["input_ids"])
    for step_1, step_2 in zip(first, second, strict=True):
        assert torch.equal(step_1["input_ids"], step_2["input_ids"])  # same rollout
        assert float(step_1["advantages"].abs().max()) > 0  # not a comparison of zeros
        assert torch.allclose(step_1["advantages"], step_2["advantages"], atol=1e-6, rtol=0)
    assert two["replicas_identical"]


def test_nan_on_one_rank_skips_the_step_everywhere_and_the_run_goes_on(dp2):
    poisoned, after = dp2["nan"]["steps"]
    assert poisoned["metrics"]["actor/skipped_steps"] == 2  # both mini-batches
    assert math.isnan(poisoned["metrics"]["actor/grad_norm"])
    assert poisoned["weights_unchanged"]
    assert after["metrics"]["actor/skipped_steps"] == 0 and not after["weights_unchanged"]
    assert dp2["nan"]["replicas_identical"]


def test_offloading_between_steps_changes_nothing(dp2):
    plain, offloaded = dp2["kl_fixed"]["steps"], dp2["offload"]["steps"]
    for a, b in zip(plain, offloaded, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
        keys = [k for k in a["metrics"] if not k.startswith(("timing_s/", "perf/throughput"))]
        assert {k: a["metrics"][k] for k in keys} == {k: b["metrics"][k] for k in keys}


@pytest.mark.parametrize("name", ["kl_fixed", "offload"])
def test_the_trainer_applies_the_declared_residency_in_every_phase(spec, dp2, name):
    """What the models report after each phase change is what planner/residency.py declares
    (the planner sums the same declaration: tests/planner/test_memory_plan.py); every phase of a
    step is visited, in the step's order."""
    from megarl.config import load_config
    from megarl.planner.residency import phases_of, residency

    overrides = next(r["overrides"] for r in spec["runs"] if r["name"] == name)
    cfg = load_config([spec["config"]], [*spec["overrides"], *overrides])
    log = dp2[name]["residency"]
    for phase, applied in log:
        assert applied == residency(cfg, phase), (phase, applied)
    step = ["generate", "reward", "old_log_prob", "ref", "values", "update_critic",
            "update_actor", "sync"]  # fmt: skip
    assert [p for p, _ in log] == ["setup", "sync", *step, *step]
    assert set(phases_of(cfg)) == {"setup", *step, "checkpoint"}
    on_host = {(p, role) for p, r in log for role, m in r.models.items() if not m.params}
    if name == "offload":  # each model's parameters leave the device outside its own passes
        assert {("setup", "actor"), ("setup", "critic"), ("setup", "ref"), ("ref", "actor"),
                ("update_actor", "critic"), ("update_actor", "ref")} <= on_host  # fmt: skip
    else:
        assert on_host == set()


def test_gae_with_a_critic_is_layout_independent(dp1, dp2):
    one, two = dp1["gae"]["steps"], dp2["gae"]["steps"]
    assert torch.equal(one[0]["input_ids"], two[0]["input_ids"])
    for key in ("values", "advantages", "returns"):
        assert float(one[0][key].abs().max()) > 0, key
        assert torch.allclose(one[0][key], two[0][key], atol=1e-6, rtol=0), key
    for run in (one, two):
        m = run[1]["metrics"]
        assert math.isfinite(m["critic/vf_loss"]) and "critic/vf_explained_var" in m
        assert m["critic/skipped_steps"] == 0
    assert dp2["gae"]["replicas_identical"]


def test_kl_in_the_reward_by_hand(dp2):
    step = dp2["kl_fixed"]["steps"][1]  # step 2: the actor has moved away from the reference
    kl = (step["old_log_probs"] - step["ref_log_probs"]) * step["mask"]  # the k1 estimator
    expected = step["token_level_scores"] - 0.1 * kl
    assert float(kl.abs().max()) > 1e-3
    assert torch.allclose(step["token_level_rewards"], expected, atol=1e-7, rtol=0)


def test_adaptive_kl_controller_follows_verls_rule(dp2):
    steps = dp2["kl_adaptive"]["steps"]
    coef, responses = 0.2, int(steps[0]["mask"].shape[0])
    for step in steps:
        m = step["metrics"]
        assert m["actor/reward_kl_penalty_coeff"] == pytest.approx(coef, rel=1e-12)
        error = min(max(m["actor/reward_kl_penalty"] / 0.01 - 1.0, -0.2), 0.2)
        coef *= 1.0 + error * responses / 40
    assert steps[-1]["metrics"]["actor/reward_kl_penalty_coeff"] != 0.2


def test_remax_baseline_is_the_greedy_samples_score(dp2):
    (step,) = dp2["remax_greedy"]["steps"]
    expected = step["greedy_scores"].repeat_interleave(4)  # rollout.n = 4
    assert float(expected.abs().max()) > 0
    assert torch.equal(step["reward_baselines"].float(), expected.float())


def test_decoupled_first_mini_batch_has_ratio_one(dp2):
    (step,) = dp2["decoupled"]["steps"]
    m = step["metrics"]
    assert abs(m["actor/ppo_kl"]) <= 1e-6 and m["actor/pg_clipfrac"] <= 1e-6
    assert "rollout_corr/rollout_is_mean" in m


def test_bypass_mode_runs_no_old_log_prob_pass(dp2):
    """verl 0.9.1's bypass mode sets old_log_probs = rollout_log_probs and skips the actor's
    old-log-prob forward; the update's first mini-batch then sees the rollout's log-probs."""
    run = dp2["bypass"]
    (step,) = run["steps"]
    phases = [phase for phase, _ in run["residency"]]
    assert "old_log_prob" not in phases and "update_actor" in phases, phases
    assert "timing_s/old_log_prob" not in step["metrics"]
    assert torch.equal(step["old_log_probs"], step["rollout_log_probs"])
    assert step["metrics"]["actor/skipped_steps"] == 0 and not step["weights_unchanged"]


def test_bf16_training_starts_from_the_loaded_weights(dp2):
    (step,) = dp2["bf16_lr0"]["steps"]
    # lr 0: the step writes the optimizer's main parameters back; they are the loaded weights
    # only if the optimizer was built after the load (bf16 main parameters are clones).
    assert step["metrics"]["actor/skipped_steps"] == 0 and step["weights_unchanged"]


def test_reward_model_scores_reach_the_rewards(dp2, spec):
    """Every response's score is HF's ``LlamaForSequenceClassification`` score of the response
    decoded and re-rendered with the reward model's template (:mod:`megarl.reward.retokenize`)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megarl.reward.retokenize import reward_model_input_ids

    rm_path = Path(spec["tmp"]) / "rm"
    hf = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32)
    rm_tokenizer = AutoTokenizer.from_pretrained(rm_path)
    actor_tokenizer = AutoTokenizer.from_pretrained(Path(spec["tmp"]) / "model")
    for step in dp2["reward_model"]["steps"]:
        inputs, got = [], []
        for i, plen in enumerate(step["prompt_lengths"].tolist()):
            length = int(step["mask"][i].sum())
            response = step["input_ids"][i, plen : plen + length].tolist()
            inputs.append(reward_model_input_ids(
                step["raw_prompts"][i // 4], response, actor_tokenizer, rm_tokenizer
            ))  # fmt: skip
            assert "[INST]" in rm_tokenizer.decode(inputs[-1])
            got.append(float(step["token_level_rewards"][i, length - 1]))
            assert step["token_level_rewards"][i].count_nonzero() == 1
        padded = rm_tokenizer.pad({"input_ids": inputs}, padding_side="right", return_tensors="pt")
        with torch.no_grad():
            expected_t = hf(**padded).logits[:, 0]  # HF: the last non-pad token's score
        got_t = torch.tensor(got)
        assert len(set(expected_t.tolist())) > 1
        assert (got_t - expected_t).abs().max() <= 1e-4, (got_t, expected_t)
        m = step["metrics"]
        assert m["critic/score/mean"] == pytest.approx(float(expected_t.mean()), abs=1e-4)
        assert m["critic/score/max"] == pytest.approx(float(expected_t.max()), abs=1e-4)
        assert m["critic/score/min"] == pytest.approx(float(expected_t.min()), abs=1e-4)


def test_ppo_learns_on_the_synthetic_task(dp2):
    """PPO (configs/ppo_tiny_cpu.yaml) for 20 steps: the critic learns and the actor's greedy
    validation rises.

    Measured at 20 steps (trainer.seed 1, 2, 3; this launch's model and data; 2026-11-27):
    ``critic/vf_explained_var`` starts at -37, -10, -18 (the seeded value head's noise, std
    ~0.8 against returns of std ~0.2) and its median over the last 10 steps is 0.05, -0.04,
    -0.05; with the critic's lr at 0 it stays at -8.4 (fails the bar). About 0 is all this task
    allows this soon: once the policy answers with digits (by step ~10) the returns' spread is
    whether the sum is right, which a random 4-layer critic does not learn that fast (a
    zero-initialised head stayed within +-0.03). The median (single steps whose returns hardly
    vary read -8 to -78) must exceed -0.5; at 30 steps (the earlier length, medians -0.08 to
    -0.006) a critic trained towards the negated returns (broken on purpose) read -1.1.
    Greedy validation went 0.077 -> 0.55, 0.12 -> 0.54, 0.13 -> 0.55 (the same at 30 steps);
    the acceptance bar is a gain of VALIDATION_GAIN (a frozen actor, lr 0, gains 0 and fails
    it; the earlier bar, r0 - 0.02, passed with a frozen actor).
    """
    run = dp2["ppo_learning"]
    explained = [step["metrics"]["critic/vf_explained_var"] for step in run["steps"]]
    late = statistics.median(explained[-10:])
    print(f"vf_explained_var first {explained[0]:.3f}, median of the last 10 {late:.3f}; "
          f"validation {run['val_before']:.4f} -> {run['val_after']:.4f}")  # fmt: skip
    assert late > EXPLAINED_VAR_FLOOR
    assert run["val_after"] - run["val_before"] >= VALIDATION_GAIN
