"""``*.megatron.use_dist_checkpointing`` + ``dist_checkpointing_path``: initial weights from a
checkpoint written by ``megarl convert hf-to-megatron`` (at TP=2), loaded at other layouts.

The loads run in the world-2 launch of ``_parallel_worker.py`` (``ws2``); the checkpoint is the
session's ``qwen2_tp2`` conversion (conftest.py), so neither costs a launch of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.trainer.setup import initial_checkpoint

ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")


@pytest.mark.multirank
@pytest.mark.parametrize(
    "key",
    ["tp2_pp1_vppNone/actor", "tp1_pp2_vppNone/critic", "tp1_pp2_vpp2/actor",
     "tp1_pp2_vppNone_last3/actor"],
)  # fmt: skip
def test_initial_weights_from_the_converted_checkpoint_equal_those_from_hf(key, ws2):
    """``_last3``: at PP 2 split unevenly (``num_layers_in_last_pipeline_stage=3``: stage 0
    holds 1 of the 4 layers, stage 1 the other 3)."""
    assert ws2[f"dist_ckpt_init/{key}"] <= 1e-6
    if key.endswith("_last3/actor"):
        assert ws2[f"dist_ckpt_init/{key}/layers"] == [[1], [3]]


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["ep1_actor", "ep2_critic"])
def test_moe_initial_weights_from_the_converted_ep2_checkpoint_equal_those_from_hf(key, ws2):
    """Qwen3-MoE converted at EP 2, loaded as the actor at EP 1 and as the critic at EP 2."""
    r = ws2[f"moe/dist_ckpt_init_{key}"]
    assert r["experts"] > 0 and r["max_diff"] <= 1e-6, r


@pytest.mark.multirank
def test_a_checkpoint_of_another_model_is_refused_at_load_naming_path_and_mismatch(ws2, qwen2_tp2):
    message = ws2["dist_ckpt_init/other_shape"]
    assert str(qwen2_tp2[0]) in message
    assert "architecture Qwen2ForCausalLM (model.path: LlamaForCausalLM)" in message
    assert "vocab_size 1100 (model.path: 1000)" in message


@pytest.fixture
def ppo_config(tmp_path):
    """``configs/ppo_tiny_cpu.yaml`` on ``model`` with empty train/val files (validation with
    check_paths only asks that they exist)."""
    for name in ("train", "val"):
        (tmp_path / f"{name}.parquet").touch()

    def make(model: Path, *overrides: str):
        return load_config(
            ["configs/ppo_tiny_cpu.yaml"],
            [
                f"actor_rollout_ref.model.path={model}",
                "actor_rollout_ref.model.architecture.vocab_size=1100",
                f"data.train_files=[{tmp_path}/train.parquet]",
                f"data.val_files=[{tmp_path}/val.parquet]",
                *overrides,
            ],
        )

    return make


def dist_ckpt_overrides(ckpt: Path) -> list[str]:
    return [
        f"{role}.megatron.{k}={v}"
        for role in ROLES
        for k, v in (("use_dist_checkpointing", "true"), ("dist_checkpointing_path", ckpt))
    ]


def test_verl_keys_validate_and_reach_the_model_builder(ppo_config, qwen2, qwen2_tp2):
    cfg = ppo_config(qwen2, *dist_ckpt_overrides(qwen2_tp2[0]))
    validate(cfg, check_paths=True)
    arr = cfg.actor_rollout_ref
    for meg in (arr.actor.megatron, arr.ref.megatron, cfg.critic.megatron):
        assert initial_checkpoint(meg) == qwen2_tp2[0]


def test_the_reference_does_not_follow_the_actors_switch(ppo_config, qwen2, qwen2_tp2):
    actor = "actor_rollout_ref.actor.megatron"
    cfg = ppo_config(
        qwen2,
        f"{actor}.use_dist_checkpointing=true",
        f"{actor}.dist_checkpointing_path={qwen2_tp2[0]}",
    )
    assert initial_checkpoint(cfg.actor_rollout_ref.actor.megatron) == qwen2_tp2[0]
    assert initial_checkpoint(cfg.actor_rollout_ref.ref.megatron) is None  # HF, as in verl
    assert initial_checkpoint(cfg.critic.megatron) is None


def test_another_model_is_refused_at_validation_in_one_line_per_role(
    ppo_config, tmp_path, qwen2_tp2
):
    from megarl.models.tiny import make_tiny_model

    other = make_tiny_model(tmp_path / "wider", "qwen2", vocab_size=1100, hidden_size=64)
    cfg = ppo_config(
        other,
        "actor_rollout_ref.model.architecture.hidden_size=64",
        *dist_ckpt_overrides(qwen2_tp2[0]),
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg, check_paths=True)
    lines = [x for x in str(err.value).splitlines() if "dist_checkpointing_path" in x]
    assert len(lines) == 3
    for role, line in zip(ROLES, lines, strict=True):
        assert f"{role}.megatron.dist_checkpointing_path='{qwen2_tp2[0]}'" in line
        assert "holds another model: hidden_size 128 (model.path: 64)" in line


def test_a_missing_path_or_a_directory_without_a_checkpoint_is_refused(ppo_config, tmp_path, qwen2):
    actor = "actor_rollout_ref.actor.megatron"
    cfg = ppo_config(qwen2, f"{actor}.use_dist_checkpointing=true")
    with pytest.raises(ConfigError, match=f"{actor}.use_dist_checkpointing=true needs"):
        validate(cfg, check_paths=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = ppo_config(
        qwen2, f"{actor}.use_dist_checkpointing=true", f"{actor}.dist_checkpointing_path={empty}"
    )
    with pytest.raises(ConfigError, match="is not a Megatron distributed checkpoint"):
        validate(cfg, check_paths=True)
    validate(cfg)  # a cluster config checked on a laptop: a warning only
