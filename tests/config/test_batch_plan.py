"""BatchPlan: verl's batch units as one object (prompts per step and mini-batch, responses per
DP rank and micro-batch), its errors naming keys, and dynamic batch sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import BatchPlan, ConfigError, load_config

GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"
ACTOR = "actor_rollout_ref.actor"
ROLL = "actor_rollout_ref.rollout"

# verl's example: 1024 prompts × n=5, mini-batch 256 prompts, micro-batch 4 per GPU, DP=8
VERL_EXAMPLE = [
    "trainer.n_gpus_per_node=8",
    f"{ACTOR}.megatron.tensor_model_parallel_size=1",
    f"{ROLL}.tensor_model_parallel_size=1",
    "data.train_batch_size=1024",
    f"{ROLL}.n=5",
    f"{ACTOR}.ppo_mini_batch_size=256",
    f"{ACTOR}.ppo_micro_batch_size_per_gpu=4",
    f"{ROLL}.log_prob_micro_batch_size_per_gpu=16",
]


def plan(*extra: str, world: int | None = None) -> BatchPlan:
    return BatchPlan.from_config(load_config(GRPO, [*VERL_EXAMPLE, *extra]), world)


def test_verls_example_numbers():
    p = plan()
    assert p.data_parallel_size == 8 and p.rollout_data_parallel_size == 8
    assert p.responses_per_step == 5120
    assert p.mini_batches_per_step == 4
    assert p.responses_per_mini_batch == 1280
    assert p.responses_per_rank_per_mini_batch == 160
    assert p.micro_batches_per_mini_batch == 40
    assert p.actor.micro_batch_size == 4 and not p.actor.dynamic
    assert p.prompts_per_rollout_rank == 128
    # log-prob passes cover the whole step: 5120 / 8 = 640 responses per rank
    assert (p.old_log_prob.responses_per_rank, p.old_log_prob.micro_batches_per_rank) == (640, 40)
    assert p.ref_log_prob is not None and p.ref_log_prob.micro_batches_per_rank == 40  # KL loss
    assert p.critic is None and p.values is None  # GRPO has no critic


def test_critic_passes_use_their_own_keys():
    p = plan("critic.enable=true", "critic.ppo_mini_batch_size=128",
             "critic.ppo_micro_batch_size_per_gpu=8")  # fmt: skip
    assert p.critic is not None and p.values is not None
    assert (p.critic.batches_per_step, p.critic.responses_per_batch) == (8, 640)
    assert (p.critic.responses_per_rank, p.critic.micro_batches_per_rank) == (80, 10)
    assert (p.values.responses_per_rank, p.values.micro_batches_per_rank) == (640, 80)


def test_dynamic_batch_size_is_decided_at_run_time():
    p = plan(f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=4096")
    assert p.actor.dynamic and p.micro_batches_per_mini_batch is None
    assert p.actor.micro_batch_size is None and p.actor.max_token_len_per_gpu == 4096
    assert p.actor.micro_key == f"{ACTOR}.ppo_max_token_len_per_gpu"
    assert p.mini_batches_per_step == 4 and p.responses_per_rank_per_mini_batch == 160
    # the log-prob passes follow the actor's switch and budget unless set
    assert p.old_log_prob.dynamic and p.old_log_prob.max_token_len_per_gpu == 4096
    assert p.ref_log_prob is not None and p.ref_log_prob.dynamic


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["data.train_batch_size=1000"],
         ["data.train_batch_size=1000", f"{ACTOR}.ppo_mini_batch_size=256"]),
        ([f"{ACTOR}.ppo_micro_batch_size_per_gpu=3"],
         [f"{ACTOR}.ppo_mini_batch_size", f"{ROLL}.n", f"{ACTOR}.ppo_micro_batch_size_per_gpu",
          "1280", "3 × 8"]),
        ([f"{ROLL}.log_prob_micro_batch_size_per_gpu=48"],
         [f"{ROLL}.log_prob_micro_batch_size_per_gpu=48", "640 responses"]),
        ([f"{ACTOR}.ppo_micro_batch_size_per_gpu=null"],
         [f"{ACTOR}.ppo_micro_batch_size_per_gpu must be set", f"{ACTOR}.use_dynamic_bsz"]),
        ([f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=100"],
         [f"{ACTOR}.ppo_max_token_len_per_gpu=100", "data.max_prompt_length"]),
        ([f"{ROLL}.tensor_model_parallel_size=3", "trainer.n_gpus_per_node=9",
          f"{ACTOR}.megatron.tensor_model_parallel_size=3"],
         ["data.train_batch_size=1024", "3 vLLM engines"]),
    ],
)  # fmt: skip
def test_errors_name_the_keys(overrides, names):
    with pytest.raises(ConfigError) as info:
        plan(*overrides)
    for name in names:
        assert name in str(info.value), (name, str(info.value))
