"""Loading: schema docs and defaults, _base_ inheritance, overrides, coercion, follows, ${...}."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import yaml

from megarl.config import (
    ConfigError,
    MegarlConfig,
    from_dict,
    get_key,
    load_config,
    resolve_config,
    to_yaml,
)
from megarl.config.keys import FOLLOWS, field_docs, iter_fields
from megarl.config.loader import all_keys

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def error_of(paths, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(paths, overrides)
    return str(info.value)


# -- schema ------------------------------------------------------------------------------------


def test_every_field_has_a_one_line_docstring():
    for key, field, owner in iter_fields(MegarlConfig):
        doc = field_docs(owner).get(field.name)
        assert doc, f"{key} has no docstring"
        assert "\n" not in doc, f"{key}: the docstring should be one line"


# verl's documented defaults (ppo_megatron_trainer.yaml / seeds) that megarl keeps.
VERL_DEFAULTS = {
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.train_batch_size": 1024,
    "data.truncation": "error",
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_high": 0.2,
    "actor_rollout_ref.actor.clip_ratio_c": 3.0,
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff": 0.0,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 1,
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size": None,
    "actor_rollout_ref.actor.megatron.sequence_parallel": True,
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer": True,
    "actor_rollout_ref.actor.megatron.param_offload": False,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.top_k": -1,
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 0.0,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": False,
    "critic.optim.lr": 1e-5,
    "critic.cliprange_value": 0.5,
    "algorithm.adv_estimator": "gae",
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1,
    "reward_model.enable": False,
    "custom_reward_function.name": "compute_score",
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.total_epochs": 30,
    "trainer.save_freq": -1,
    "trainer.test_freq": -1,
    "trainer.critic_warmup": 0,
    "trainer.resume_mode": "auto",
    "trainer.default_local_dir": "checkpoints/verl_examples/gsm8k",
}


def test_defaults_follow_verl():
    cfg = load_config([])
    for key, expected in VERL_DEFAULTS.items():
        assert get_key(cfg, key) == expected, key


def test_follow_sources_and_targets_are_schema_keys():
    cfg = MegarlConfig()
    for key, source in FOLLOWS:
        get_key(cfg, key)
        get_key(cfg, source)


def test_following_keys_default_to_unset_and_resolve_in_one_place():
    cfg = MegarlConfig()
    assert [key for key, _ in FOLLOWS if get_key(cfg, key) is not None] == []
    resolved = resolve_config(cfg)
    for key, source in FOLLOWS:
        assert get_key(resolved, key) == get_key(resolved, source), key
    assert resolved.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"  # ${...}


def test_resolved_defaults_equal_a_config_loaded_from_an_empty_file(tmp_path):
    loaded = load_config(write(tmp_path / "empty.yaml", ""))
    built = resolve_config(MegarlConfig())
    assert [k for k in all_keys() if get_key(built, k) != get_key(loaded, k)] == []
    assert built == loaded


def test_an_unset_follower_takes_the_changed_source_an_explicit_one_stays():
    cfg = load_config([], ["actor_rollout_ref.actor.clip_ratio=0.3", "critic.ppo_epochs=3"])
    actor = cfg.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.3, 0.3)
    assert cfg.critic.ppo_epochs == 3 and actor.ppo_epochs == 1
    built = MegarlConfig()
    built.actor_rollout_ref.actor.megatron.tensor_model_parallel_size = 4
    assert resolve_config(built).critic.megatron.tensor_model_parallel_size == 4


def test_a_section_set_in_part_keeps_its_own_defaults_for_the_rest():
    """The critic's optimizer defaults to lr 1e-5 (not OptimConfig's 1e-6), set or not."""
    cfg = load_config([], ["critic.optim.weight_decay=0.1"])
    assert (cfg.critic.optim.lr, cfg.critic.optim.weight_decay) == (1e-5, 0.1)
    assert load_config([]).critic.optim.lr == 1e-5


# -- files and inheritance -------------------------------------------------------------------


def test_base_files_merge_in_order_then_the_file_itself(tmp_path):
    write(tmp_path / "a.yaml", "trainer: {project_name: a, experiment_name: a, seed: 1}\n")
    write(tmp_path / "sub/b.yaml", "trainer: {experiment_name: b, seed: 2}\n")
    top = write(
        tmp_path / "top.yaml",
        """
        _base_: [a.yaml, sub/b.yaml]
        trainer:
          seed: 3
        """,
    )
    cfg = load_config(top)
    assert (cfg.trainer.project_name, cfg.trainer.experiment_name, cfg.trainer.seed) == (
        "a",
        "b",
        3,
    )
    assert cfg.trainer.nnodes == 1  # untouched keys keep their defaults


def test_nested_bases_resolve_relative_to_each_file(tmp_path):
    write(tmp_path / "x/base.yaml", "data: {train_batch_size: 8}\n")
    write(tmp_path / "x/mid.yaml", "_base_: base.yaml\ndata: {max_prompt_length: 7}\n")
    top = write(tmp_path / "top.yaml", "_base_: x/mid.yaml\n")
    cfg = load_config(str(top))
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length) == (8, 7)


def test_several_config_files_merge_in_order(tmp_path):
    one = write(tmp_path / "1.yaml", "data: {train_batch_size: 8, max_prompt_length: 9}\n")
    two = write(tmp_path / "2.yaml", "data: {train_batch_size: 16}\n")
    cfg = load_config([one, two])
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length) == (16, 9)


def test_lists_are_replaced_not_merged(tmp_path):
    base = write(tmp_path / "b.yaml", "trainer: {logger: [console, mlflow]}\n")
    top = write(tmp_path / "t.yaml", f"_base_: {base.name}\ntrainer: {{logger: [console]}}\n")
    assert load_config(top).trainer.logger == ["console"]


def test_inheritance_cycle_and_missing_files_are_errors(tmp_path):
    write(tmp_path / "a.yaml", "_base_: b.yaml\n")
    write(tmp_path / "b.yaml", "_base_: a.yaml\n")
    assert "cycle" in error_of(tmp_path / "a.yaml")
    write(tmp_path / "c.yaml", "_base_: nowhere.yaml\n")
    message = error_of(tmp_path / "c.yaml")
    assert "nowhere.yaml" in message and "c.yaml" in message
    assert "not found" in error_of(tmp_path / "absent.yaml")


def test_bad_yaml_and_bad_top_level_name_the_file(tmp_path):
    bad = write(tmp_path / "bad.yaml", "data: [unclosed\n")
    assert "bad.yaml" in error_of(bad) and "invalid YAML" in error_of(bad)
    listing = write(tmp_path / "list.yaml", "- a\n- b\n")
    assert "mapping" in error_of(listing)


def test_empty_section_keeps_defaults(tmp_path):
    cfg = load_config(write(tmp_path / "e.yaml", "critic:\ntrainer:\n  seed: 5\n"))
    assert cfg.critic == resolve_config(MegarlConfig()).critic and cfg.trainer.seed == 5


# -- overrides and coercion ------------------------------------------------------------------


def test_override_values_are_coerced_to_the_field_types():
    cfg = load_config(
        [],
        [
            "data.train_batch_size=64",
            "actor_rollout_ref.actor.optim.lr=1e-5",  # YAML 1.1 reads 1e-5 as a string
            "actor_rollout_ref.actor.use_kl_loss=True",
            "trainer.val_before_train=false",
            "trainer.logger=['console','mlflow']",
            "data.train_files=/data/one.parquet",
            "trainer.total_training_steps=null",
            "critic.enable=None",
            "trainer.experiment_name=007",
            "trainer.project_name='quoted name'",
            "actor_rollout_ref.actor.clip_ratio=1",
            "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
        ],
    )
    assert cfg.data.train_batch_size == 64
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5
    assert cfg.actor_rollout_ref.actor.use_kl_loss is True
    assert cfg.trainer.val_before_train is False
    assert cfg.trainer.logger == ["console", "mlflow"]
    assert cfg.data.train_files == ["/data/one.parquet"]
    assert cfg.trainer.total_training_steps is None and cfg.critic.enable is None
    assert cfg.trainer.experiment_name == "007"
    assert cfg.trainer.project_name == "quoted name"
    assert cfg.actor_rollout_ref.actor.clip_ratio == 1.0
    assert isinstance(cfg.actor_rollout_ref.actor.clip_ratio, float)
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.9, 0.95]


def test_a_mapping_override_updates_the_section(tmp_path):
    path = write(tmp_path / "t.yaml", "trainer: {seed: 5, project_name: p}\n")
    cfg = load_config(path, ["trainer={seed: 6, experiment_name: e}"])
    assert (cfg.trainer.seed, cfg.trainer.project_name, cfg.trainer.experiment_name) == (
        6,
        "p",
        "e",
    )


def test_type_error_names_the_key():
    message = error_of([], ["data.train_batch_size=abc"])
    assert "data.train_batch_size" in message and "integer" in message and "'abc'" in message


def test_yaml_type_errors_name_the_key(tmp_path):
    path = write(
        tmp_path / "t.yaml",
        """
        trainer: {n_gpus_per_node: 1.5, val_before_train: maybe, logger: [console, {a: 1}]}
        actor_rollout_ref: {actor: {megatron: 4}}
        """,
    )
    message = error_of(path)
    for key in [
        "trainer.n_gpus_per_node",
        "trainer.val_before_train",
        "trainer.logger[1]",
        "actor_rollout_ref.actor.megatron",
    ]:
        assert key in message


def test_misspelt_key_suggests_the_right_one():
    message = error_of([], ["actor_rollout_ref.actor.clip_ratoi=0.3"])
    assert "actor_rollout_ref.actor.clip_ratoi" in message
    assert "did you mean 'actor_rollout_ref.actor.clip_ratio'" in message


def test_key_in_the_wrong_section_points_to_where_it_lives():
    message = error_of([], ["actor_rollout_ref.actor.tensor_model_parallel_size=2"])
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size" in message


def test_verl_keys_megarl_handles_differently_get_a_hint(tmp_path):
    message = error_of([], ["actor_rollout_ref.actor.fsdp_config.param_offload=true"])
    assert "fsdp_config" in message and "Megatron" in message
    message = error_of([], ["actor_rollout_ref.actor.megatron_config.tensor_model_parallel_size=2"])
    assert "'megatron'" in message
    hydra = write(tmp_path / "h.yaml", "defaults: [base]\n")
    assert "_base_" in error_of(hydra)


def test_invalid_choice_suggests_the_closest():
    message = error_of([], ["algorithm.adv_estimator=grop"])
    assert "algorithm.adv_estimator" in message and "did you mean 'grpo'" in message


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config([], ["data.train_batch_size=x", "trainer.seeed=1", "algorithm.gamma=high"])
    assert len(info.value.problems) == 3


def test_malformed_overrides():
    assert "key=value" in error_of([], ["=5"])
    assert "no '=value'" in error_of([], ["data.train_batch_size"])
    message = error_of([], ["data.train_batch_size.sub=1"])
    assert "'data.train_batch_size' is a value" in message


def test_free_form_sections_need_plus_for_new_keys():
    message = error_of([], ["actor_rollout_ref.rollout.engine_kwargs.swap_space=4"])
    assert "+actor_rollout_ref.rollout.engine_kwargs.swap_space=4" in message
    cfg = load_config(
        [],
        [
            "+actor_rollout_ref.rollout.engine_kwargs.swap_space=4",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.attention_dropout=0.0",
            "+actor_rollout_ref.rollout.engine_kwargs.nested.flag=true",
        ],
    )
    assert cfg.actor_rollout_ref.rollout.engine_kwargs == {
        "swap_space": 4,
        "nested": {"flag": True},
    }
    meg = cfg.actor_rollout_ref.actor.megatron
    assert meg.override_transformer_config == {"attention_dropout": 0.0}
    # once present, the key can be changed without '+'
    cfg = load_config(
        [],
        [
            "+actor_rollout_ref.rollout.engine_kwargs.swap_space=4",
            "actor_rollout_ref.rollout.engine_kwargs.swap_space=8",
        ],
    )
    assert cfg.actor_rollout_ref.rollout.engine_kwargs == {"swap_space": 8}


def test_plus_on_a_schema_key_sets_it_and_on_an_unknown_key_fails():
    assert load_config([], ["+trainer.seed=7"]).trainer.seed == 7
    assert "did you mean 'trainer.seed'" in error_of([], ["+trainer.sed=7"])


def test_tilde_removes_a_key(tmp_path):
    path = write(
        tmp_path / "t.yaml",
        "trainer: {seed: 5}\ncritic: {megatron: {tensor_model_parallel_size: 4}}\n",
    )
    assert load_config(path, ["~trainer.seed"]).trainer.seed == 42
    cfg = load_config(
        path,
        [
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "~critic.megatron.tensor_model_parallel_size",
        ],
    )
    assert cfg.critic.megatron.tensor_model_parallel_size == 2  # follows the actor again


# -- follows and interpolation ---------------------------------------------------------------


def test_unset_keys_follow_their_source():
    cfg = load_config(
        [],
        [
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.clip_ratio=0.3",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            "actor_rollout_ref.model.path=/models/m",
            "data.max_prompt_length=100",
        ],
    )
    arr = cfg.actor_rollout_ref
    for meg in (cfg.critic.megatron, arr.ref.megatron):
        assert (meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size) == (4, 2)
    assert (arr.actor.clip_ratio_low, arr.actor.clip_ratio_high) == (0.3, 0.28)
    assert arr.rollout.log_prob_micro_batch_size_per_gpu == 3
    assert arr.ref.log_prob_micro_batch_size_per_gpu == 3
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 3
    assert cfg.critic.model.path == "/models/m"
    assert arr.rollout.prompt_length == 100


def test_explicit_values_do_not_follow():
    cfg = load_config(
        [],
        [
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
            "critic.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        ],
    )
    assert cfg.critic.megatron.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 16


def test_interpolation_of_keys_and_environment(monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_ROOT", "/scratch")
    cfg = load_config(
        [],
        [
            "trainer.project_name=proj",
            "trainer.experiment_name=${trainer.project_name}-run",
            "trainer.default_local_dir=${oc.env:MEGARL_TEST_ROOT}/${trainer.experiment_name}",
            "trainer.tracking_uri=${oc.env:MEGARL_TEST_UNSET,file:./mlruns}",
        ],
    )
    assert cfg.trainer.experiment_name == "proj-run"
    assert cfg.trainer.default_local_dir == "/scratch/proj-run"
    assert cfg.trainer.tracking_uri == "file:./mlruns"
    assert load_config([]).trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"


def test_bad_interpolations_are_errors():
    message = error_of([], ["trainer.default_local_dir=${trainer.experiment_nam}"])
    assert "trainer.default_local_dir" in message and "trainer.experiment_name" in message
    assert "MEGARL_NOT_SET_X" in error_of([], ["trainer.project_name=${oc.env:MEGARL_NOT_SET_X}"])
    message = error_of([], ["trainer.project_name=${trainer.experiment_name}",
                            "trainer.experiment_name=${trainer.project_name}"])  # fmt: skip
    assert "cycle" in message


# -- round trip ------------------------------------------------------------------------------


def test_to_yaml_loads_back_identically(tmp_path):
    cfg = load_config(
        CONFIGS / "ppo_tiny_cpu.yaml",
        ["+actor_rollout_ref.rollout.engine_kwargs.swap_space=4", "trainer.experiment_name=007"],
    )
    text = to_yaml(cfg)
    assert load_config(write(tmp_path / "round.yaml", text)) == cfg
    assert from_dict(yaml.safe_load(text)) == cfg
    assert dataclasses.asdict(cfg) == yaml.safe_load(text)
