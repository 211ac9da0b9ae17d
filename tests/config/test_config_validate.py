"""Validation: bad configs fail with messages naming the offending keys; warnings; model facts."""

from __future__ import annotations

import json

import pytest

from megarl.config import ConfigError, load_config, validate
from tests.config._bad_configs import ARCH, BAD_CONFIGS, CONFIGS, GRPO, MEG, PPO, ROLL


@pytest.mark.parametrize(
    ("config", "overrides", "world_size", "expected"),
    [case[1:] for case in BAD_CONFIGS],
    ids=[case[0] for case in BAD_CONFIGS],
)
def test_bad_config_names_the_offending_keys(config, overrides, world_size, expected):
    cfg = load_config(config, overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size)
    message = str(info.value)
    for text in expected:
        assert text in message, f"{text!r} missing from:\n{message}"


def test_the_tiny_configs_are_valid_as_shipped():
    for path in (GRPO, PPO):
        validate(load_config(path), 2)


def test_all_problems_are_listed_together():
    cfg = load_config(
        GRPO,
        [f"{ROLL}.top_p=0.5", "trainer.save_freq=0", "critic.enable=false",
         "algorithm.adv_estimator=gae", f"{MEG}.tensor_model_parallel_size=4"],
    )  # fmt: skip
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert len(info.value.problems) >= 4
    text = str(info.value)
    assert text.startswith(f"{len(info.value.problems)} problems")
    assert all(f"  - {p}" in text for p in info.value.problems)


# -- warnings ---------------------------------------------------------------------------------


def test_kl_loss_and_kl_in_reward_together_warn():
    warnings = validate(load_config(GRPO, ["algorithm.use_kl_in_reward=true"]))
    assert any(
        "actor_rollout_ref.actor.use_kl_loss" in w and "algorithm.use_kl_in_reward" in w
        for w in warnings
    )


def test_an_aux_loss_coefficient_alone_warns_that_it_does_nothing():
    """verl's Megatron engine sets ``moe_router_load_balancing_type=none`` unless told otherwise,
    so ``moe_aux_loss_coeff`` alone balances nothing; megarl follows it and says so."""
    from tests.config._bad_configs import MOE_30B

    otc = f"+{MEG}.override_transformer_config"
    warnings = validate(load_config(MOE_30B, [f"{otc}.moe_aux_loss_coeff=0.001"]))
    assert any("moe_aux_loss_coeff=0.001 has no effect" in w for w in warnings), warnings
    on = [f"{otc}.moe_aux_loss_coeff=0.001", f"{otc}.moe_router_load_balancing_type=aux_loss"]
    assert not any("moe_aux_loss_coeff" in w for w in validate(load_config(MOE_30B, on)))


def test_opt_in_allows_truncated_sampling():
    cfg = load_config(GRPO, [f"{ROLL}.top_p=0.9", f"{ROLL}.allow_non_unit_top_p_top_k=true"])
    validate(cfg)


def test_few_micro_batches_for_the_pipeline_warn():
    cfg = load_config(PPO, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    warnings = validate(cfg)
    assert any("pipeline stages" in w and "ppo_micro_batch_size_per_gpu" in w for w in warnings)


def test_tensor_parallelism_across_nodes_warns():
    cfg = load_config(
        CONFIGS / "ppo_qwen2_5_72b.yaml",
        ["trainer.nnodes=16", "trainer.n_gpus_per_node=4", f"{ROLL}.tensor_model_parallel_size=8"],
    )
    warnings = validate(cfg)
    assert any(f"{MEG}.tensor_model_parallel_size=8 exceeds" in w for w in warnings)
    assert any(f"{ROLL}.tensor_model_parallel_size=8 exceeds" in w for w in warnings)


def test_unused_critic_and_bf16_on_cpu_warn():
    warnings = validate(load_config(GRPO, ["critic.enable=true", "trainer.dtype=bf16"]))
    assert any("critic.enable=true" in w for w in warnings)
    assert any("trainer.dtype=bf16" in w for w in warnings)


def test_missing_model_without_architecture_warns_that_shapes_were_not_checked():
    cfg = load_config(GRPO, [f"~{ARCH}"])
    warnings = validate(cfg)
    assert any("actor_rollout_ref.model.path" in w and "not checked" in w for w in warnings)


# -- model facts from config.json --------------------------------------------------------------


def test_config_json_is_the_source_of_truth(hf_model):
    path = hf_model("m")
    cfg = load_config(GRPO, [f"actor_rollout_ref.model.path={path}"])
    warnings = validate(cfg)
    assert not any("model.path" in w for w in warnings)
    bad = load_config(GRPO, [f"actor_rollout_ref.model.path={path}", f"{ARCH}.num_hidden_layers=8"])
    with pytest.raises(ConfigError) as info:
        validate(bad)
    assert f"{ARCH}.num_hidden_layers=8" in str(info.value) and "config.json" in str(info.value)


def test_kv_heads_from_config_json(hf_model):
    path = hf_model("gqa", num_attention_heads=6, num_key_value_heads=3, hidden_size=192)
    cfg = load_config(GRPO, [f"actor_rollout_ref.model.path={path}", f"~{ARCH}"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = str(info.value)
    assert "num_key_value_heads=3" in message and str(path / "config.json") in message
    assert f"{MEG}.tensor_model_parallel_size=2" in message


def test_training_tp_above_the_kv_heads_is_valid(hf_model):
    """Megatron-Core 0.16 gives each rank one KV group when TP exceeds them (as vLLM does)."""
    path = hf_model("one-kv", num_attention_heads=8, num_key_value_heads=1)
    cfg = load_config(GRPO, [f"actor_rollout_ref.model.path={path}", f"~{ARCH}"])
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    validate(cfg)


def test_small_head_dim_on_cpu_warns(hf_model):
    path = hf_model("narrow", hidden_size=64)
    cfg = load_config(GRPO, [f"actor_rollout_ref.model.path={path}", f"~{ARCH}"])
    assert any("head_dim=16" in w for w in validate(cfg))


def test_mha_models_default_kv_heads_to_heads(hf_model):
    from megarl.config.model_source import resolve_model_shape

    path = hf_model("mha", num_key_value_heads=None)
    cfg = load_config(GRPO, [f"actor_rollout_ref.model.path={path}", f"~{ARCH}"])
    validate(cfg)
    shape, errors, _ = resolve_model_shape(cfg.actor_rollout_ref.model, "m", check_paths=True)
    assert not errors and shape is not None
    assert shape.get("num_query_groups") == shape.get("num_attention_heads") == 4


def test_rollout_is_weights_with_bypass_and_ppo_clip_warn():
    cfg = load_config(
        GRPO,
        [
            "algorithm.rollout_correction.bypass_mode=true",
            "algorithm.rollout_correction.rollout_is=token",
        ],
    )
    assert any("count the correction twice" in w for w in validate(cfg))


def test_old_megarl_names_point_to_verls():
    for old, new in [
        (f"{ROLL}.logprob_mode=bypass", "algorithm.rollout_correction.bypass_mode"),
        (f"{ROLL}.is_threshold=2", "algorithm.rollout_correction.rollout_is_threshold"),
        ("actor_rollout_ref.actor.grad_clip=1", "optim.clip_grad"),
        ("critic.optim.warmup_steps=3", "optim.lr_warmup_steps"),
    ]:
        with pytest.raises(ConfigError, match=new.replace(".", r"\.")):
            load_config(GRPO, [old])


def test_directory_without_config_json_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = load_config(GRPO, [f"actor_rollout_ref.model.path={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError, match="without a config.json"):
        validate(cfg)


def test_hub_id_is_read_from_the_hf_cache(tmp_path):
    snapshot = tmp_path / "hf-cache/models--Org--Tiny/snapshots/abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(
        json.dumps({"num_attention_heads": 6, "num_key_value_heads": 3, "num_hidden_layers": 4})
    )
    cfg = load_config(GRPO, ["actor_rollout_ref.model.path=Org/Tiny", f"~{ARCH}"])
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        validate(cfg)


def test_separate_critic_model_is_checked_against_the_critic_layout(hf_model):
    critic = hf_model("critic", num_hidden_layers=3)
    cfg = load_config(PPO, [f"critic.model.path={critic}"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = str(info.value)
    assert (
        "num_hidden_layers=3 is not divisible by critic.megatron.pipeline_model_parallel_size=2"
        in message
    )
    assert str(critic / "config.json") in message


def test_check_paths_turns_missing_files_into_errors(hf_model, tmp_path):
    cfg = load_config(GRPO)
    validate(cfg)  # offline: only warnings
    with pytest.raises(ConfigError) as info:
        validate(cfg, check_paths=True)
    assert "data.train_files: 'outputs/tiny-data/train.parquet' does not exist" in str(info.value)
    # 'outputs/tiny-qwen2' could be a hub id until a local 'outputs' directory exists
    (tmp_path / "outputs").mkdir()
    with pytest.raises(ConfigError) as info:
        validate(cfg, check_paths=True)
    assert "actor_rollout_ref.model.path='outputs/tiny-qwen2' does not exist" in str(info.value)
    hf_model("outputs/tiny-qwen2")
    (tmp_path / "outputs/tiny-data").mkdir(parents=True)
    (tmp_path / "outputs/tiny-data/train.parquet").write_bytes(b"")
    no_validation = ["trainer.test_freq=-1", "trainer.val_before_train=false"]
    validate(load_config(GRPO, no_validation), check_paths=True)  # val_files are not needed
    with pytest.raises(ConfigError, match="data.val_files"):
        validate(cfg, check_paths=True)  # the tiny GRPO config validates before and every 10


# Keys megarl reads but does not apply (yet): each refused in one line naming it, never ignored.
NOT_APPLIED = [
    ("data.val_batch_size", "data.val_batch_size=8"),
]  # fmt: skip


@pytest.mark.parametrize(("key", "override"), NOT_APPLIED, ids=[k for k, _ in NOT_APPLIED])
def test_keys_not_applied_are_refused(key, override):
    with pytest.raises(ConfigError) as err:
        validate(load_config(PPO, [override]))
    lines = [line for line in str(err.value).splitlines() if key in line]
    assert lines and "not supported" in lines[0], str(err.value)


def test_verl_moe_knobs_pass_the_override_refusal():
    """``override_transformer_config.moe_*`` (verl's MoE knobs) reach the model builder
    (:class:`megarl.models.gpt.MoeSettings`); every other override is still refused."""
    ok = f"{MEG}.override_transformer_config={{moe_aux_loss_coeff: 0.01, moe_z_loss_coeff: 0.001}}"
    cfg = load_config(PPO, [ok])
    assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config == {
        "moe_aux_loss_coeff": 0.01,
        "moe_z_loss_coeff": 0.001,
    }
    try:
        validate(cfg)
    except ConfigError as exc:
        assert "override_transformer_config" not in str(exc), str(exc)


def test_verls_rollout_mode_and_gradient_checkpointing_keys_validate():
    """verl's Megatron example scripts set rollout.mode (async in verl 0.9.1, sync before) and
    model.enable_gradient_checkpointing=True; verl 0.9.1's Megatron workers read no recompute
    setting from the latter, so it changes nothing here either, and says so."""
    keys = [f"{ROLL}.mode=sync", "actor_rollout_ref.model.enable_gradient_checkpointing=True"]
    warnings = validate(load_config(GRPO, keys), 2)
    assert any("enable_gradient_checkpointing=true recomputes nothing" in w for w in warnings)
    recompute = [f"{MEG}.recompute_granularity=selective"]
    assert not any("recomputes" in w for w in validate(load_config(GRPO, keys + recompute), 2))
    critic = ["critic.model.enable_gradient_checkpointing=true", f"{ROLL}.mode=async"]
    warnings = validate(load_config(PPO, critic), 2)
    assert any(w.startswith("critic.model.enable_gradient_checkpointing") for w in warnings)
    with pytest.raises(ConfigError, match=rf"^{ROLL}.mode: 'spmd' is not one of async, sync$"):
        load_config(GRPO, [f"{ROLL}.mode=spmd"])


def test_gpu_moe_rollout_settings_that_hold_validate(monkeypatch):
    """On the GPU config: vLLM expert parallelism at the rollout TP size; R3 with eager vLLM
    (captured by hooks) or with vLLM's V2 runner (its own routed-experts output)."""
    from tests.config._bad_configs import MOE_30B

    r3 = f"{MEG}.router_replay.mode=R3"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    validate(load_config(MOE_30B, [f"{ROLL}.expert_parallel_size=4"]))
    validate(load_config(MOE_30B, [r3, f"{ROLL}.enforce_eager=true"]))
    with pytest.raises(ConfigError):
        validate(load_config(MOE_30B, [r3]))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    validate(load_config(MOE_30B, [r3]))


def test_vllm_on_ranks_of_its_own_validates_at_the_training_world():
    """2 training ranks + 1 rollout rank: validated at the training world (2)."""
    from megarl.config.batch_plan import rollout_ranks

    cfg = load_config(GRPO, [f"{ROLL}.nnodes=1", f"{ROLL}.n_gpus_per_node=1",
                             f"{ROLL}.tensor_model_parallel_size=1",
                             "async_training.staleness_threshold=1"])  # fmt: skip
    assert rollout_ranks(cfg) == 1
    validate(cfg, 2)


@pytest.mark.parametrize(
    ("ranks", "tp", "placement"),
    [(2, 1, "1 x 2 replicas on 2"), (2, 2, "2 on 2"), (4, 2, "2 x 2 replicas on 4")],
)
def test_rollout_ranks_hold_whole_vllm_replicas(ranks, tp, placement):
    """Any number of rollout ranks that the rollout TP divides: replicas of TP ranks each, as
    the run's first console line says."""
    from megarl.trainer.loop import _rollout_placement

    cfg = load_config(GRPO, [f"{ROLL}.nnodes=1", f"{ROLL}.n_gpus_per_node={ranks}",
                             f"{ROLL}.tensor_model_parallel_size={tp}"])  # fmt: skip
    validate(cfg, 2)
    said = _rollout_placement(cfg, None, None)
    assert said == f"{placement} rank(s) of its own, on-policy"


@pytest.mark.parametrize(
    ("threshold", "ahead", "said"),
    [(0, 0, "on-policy"), (0.5, 1, "one step off"), (1, 1, "one step off"),
     (2, 2, "up to 2 steps off"), (2.5, 3, "up to 3 steps off")],
)  # fmt: skip
def test_the_staleness_threshold_bounds_the_steps_asked_ahead(threshold, ahead, said):
    """verl's share of stale samples, in whole batches (rounded up): the steps whose batches the
    training loop asks for ahead, as the run's first console line says."""
    from megarl.config.batch_plan import steps_ahead
    from megarl.trainer.loop import _rollout_placement

    cfg = load_config(GRPO, [f"{ROLL}.nnodes=1", f"{ROLL}.n_gpus_per_node=1",
                             f"{ROLL}.tensor_model_parallel_size=1",
                             f"async_training.staleness_threshold={threshold}"])  # fmt: skip
    validate(cfg, 2)
    assert steps_ahead(cfg) == ahead
    assert _rollout_placement(cfg, None, None).endswith(f"own, {said}")


@pytest.mark.parametrize(
    ("config", "overrides"),
    [(GRPO.name, ["algorithm.adv_estimator=remax"]),
     ("grpo_moe_tiny_cpu.yaml", [f"{MEG}.router_replay.mode=R3",
                                 f"{ROLL}.enable_rollout_routing_replay=true"])],
    ids=["remax", "r3"],
)  # fmt: skip
def test_remax_and_r3_run_with_vllm_on_ranks_of_its_own(config, overrides):
    """Both were refused with rollout ranks until their requests reached the rollout ranks
    (tests/trainer/test_disaggregated.py runs each)."""
    validate(load_config(CONFIGS / config, [f"{ROLL}.nnodes=1", f"{ROLL}.n_gpus_per_node=2",
                                            f"{ROLL}.tensor_model_parallel_size=1",
                                            "async_training.staleness_threshold=1",
                                            *overrides]), 2)  # fmt: skip
