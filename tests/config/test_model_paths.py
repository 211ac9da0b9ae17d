"""Model path keys resolve to one local directory: hub ids through the local HF cache only."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.config.model_paths import resolve_model_path

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GRPO = CONFIGS / "grpo_tiny_cpu.yaml"
GRPO_7B = CONFIGS / "grpo_qwen2_5_7b.yaml"
KEY = "actor_rollout_ref.model.path"


def _cache_snapshot(hub: Path, repo_id: str, rev: str = "0123abcd") -> Path:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<rev>/}."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (repo / "snapshots" / "stale").mkdir()  # an older snapshot refs/main no longer names
    return snapshot


def test_hub_id_in_the_hf_home_cache_resolves_to_its_snapshot(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    snapshot = _cache_snapshot(tmp_path / "hf-home" / "hub", "Org/Tiny")
    assert resolve_model_path("Org/Tiny", KEY) == str(snapshot)


def test_absent_hub_id_fails_in_one_line_naming_key_and_id():
    with pytest.raises(ValueError) as info:
        resolve_model_path("Qwen/Qwen2.5-7B-Instruct", KEY)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{KEY}='Qwen/Qwen2.5-7B-Instruct' is a hub id not in the")


def test_check_paths_rewrites_every_model_key_to_the_same_directory(hf_model, tmp_path):
    snapshot = _cache_snapshot(tmp_path / "hf-cache", "Org/Tiny")
    hf_model(str(snapshot.relative_to(tmp_path)))
    data = tmp_path / "outputs/tiny-data"
    data.mkdir(parents=True)
    (data / "train.parquet").write_bytes(b"")
    (data / "test.parquet").write_bytes(b"")
    cfg = load_config(GRPO, [f"{KEY}=Org/Tiny", "actor_rollout_ref.model.tokenizer_path=Org/Tiny"])
    validate(cfg, check_paths=True)
    assert cfg.actor_rollout_ref.model.path == str(snapshot)
    assert cfg.actor_rollout_ref.model.tokenizer_path == str(snapshot)
    validate(cfg, check_paths=True)  # idempotent: the snapshot resolves to itself
    assert cfg.actor_rollout_ref.model.path == str(snapshot)


def test_shipped_gpu_configs_fail_pre_flight_in_one_line_without_the_model():
    cfg = load_config(GRPO_7B)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=8, check_paths=True)
    lines = [line for line in str(info.value).splitlines() if KEY in line]
    assert len(lines) == 1 and "'Qwen/Qwen2.5-7B-Instruct' is a hub id not in" in lines[0]


def test_paths_of_disabled_models_are_not_resolved():
    from megarl.config.model_paths import resolve_model_paths

    cfg = load_config(GRPO, ["reward_model.model.path=Org/Absent", "critic.model.path=Org/Gone"])
    cfg.actor_rollout_ref.model.path = None
    assert resolve_model_paths(cfg) == []  # GRPO: no critic; reward_model.enable is false
    assert cfg.reward_model.model.path == "Org/Absent"
