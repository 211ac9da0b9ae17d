"""Every key of verl 0.9.1's PPO Megatron trainer config is accepted or refused as
"unsupported: <key>=<value>" (with a reason and verl's default, which is accepted), never
"unknown".

``VERL_0_9_1_KEYS`` are the fully expanded dotted keys of verl 0.9.1's composed
``ppo_megatron_trainer.yaml``, read from the vendored file (``megarl/config/data/``; its header
names the source).
"""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, from_dict, load_config
from megarl.config.loader import all_keys
from megarl.config.verl_defaults import verl_defaults

VERL_0_9_1_KEYS: tuple[str, ...] = tuple(verl_defaults())


def _nested(keys: tuple[str, ...]) -> dict:
    """``{"a": {"b": None}}`` for ``("a.b",)``: every key set to null, as in a YAML file."""
    raw: dict = {}
    for key in keys:
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = None
    return raw


def _problems(raw: dict) -> list[str]:
    try:
        from_dict(raw)
    except ConfigError as exc:
        return exc.problems
    return []


def test_the_list_is_verl_0_9_1s():
    assert len(VERL_0_9_1_KEYS) == len(set(VERL_0_9_1_KEYS)) == 942
    assert "actor_rollout_ref.actor.optim.clip_grad" in VERL_0_9_1_KEYS
    assert "algorithm.rollout_correction.bypass_mode" in VERL_0_9_1_KEYS


def test_every_verl_key_is_accepted_or_unsupported():
    problems = _problems(_nested(VERL_0_9_1_KEYS))
    unknown = [p for p in problems if "unknown key" in p or "not a section" in p]
    assert not unknown, "\n".join(unknown)
    unsupported = [p for p in problems if p.startswith("unsupported: ")]
    assert len(unsupported) > 100  # megarl supports a subset, and says so key by key
    assert all(p.endswith(")") and " (" in p for p in unsupported)  # each with its reason
    assert all("verl's default" in p for p in unsupported)  # and the value that works
    # every other problem is a value problem of a key megarl has (null where a value is needed)
    for p in problems:
        assert p in unsupported or p.split(":")[0].split(" ")[0] in all_keys(), p


def test_verls_names_megarl_uses_are_accepted():
    for key in (
        "algorithm.rollout_correction.rollout_is",
        "algorithm.rollout_correction.rollout_is_threshold",
        "algorithm.rollout_correction.rollout_rs",
        "algorithm.rollout_correction.bypass_mode",
        "actor_rollout_ref.actor.optim.clip_grad",
        "actor_rollout_ref.actor.optim.lr_warmup_steps",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "critic.forward_max_token_len_per_gpu",
        "trainer.balance_batch",
    ):
        assert key in VERL_0_9_1_KEYS and key in all_keys(), key
        assert not [p for p in _problems(_nested((key,))) if "unsupported" in p or "unknown" in p]


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (
            {"global_profiler": {"tool": "nsys"}},
            (
                "unsupported: global_profiler.tool=nsys (no profiler integration; verl's default "
                "null is accepted)"
            ),
        ),
        (
            {"actor_rollout_ref": {"actor": {"optim": {"muon_momentum": 0.9}}}},
            "unsupported: actor_rollout_ref.actor.optim.muon_momentum=0.9 (no Muon",
        ),
        (
            {"actor_rollout_ref": {"rollout": {"skip": {"enable": True}}}},
            "unknown key 'actor_rollout_ref.rollout.skip'",
        ),
    ],
)
def test_unsupported_keys_in_a_file_name_the_key_and_the_reason(raw, needle):
    with pytest.raises(ConfigError) as info:
        from_dict(raw)
    assert needle in str(info.value)
    assert ("unknown" in needle) == ("unknown" in str(info.value))


def test_unsupported_keys_on_the_command_line(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "empty.yaml", ["actor_rollout_ref.rollout.full_determinism=true"])
    assert str(info.value) == (
        "unsupported: actor_rollout_ref.rollout.full_determinism=true (use engine_kwargs; "
        "verl's default false is accepted)"
    )


def test_a_typo_is_still_unknown():
    for key in ("actor_rollout_ref.actor.clip_ratoi", "trainer.balance_bach"):
        assert any("unknown key" in p for p in _problems(_nested((key,)))), key


def test_the_dump_directories_are_supported(tmp_path):
    """The trainer writes rollout and validation dumps there: not in the unsupported list."""
    from megarl.config.verl_keys import unsupported_reason

    (tmp_path / "empty.yaml").write_text("")
    for key in ("trainer.rollout_data_dir", "trainer.validation_data_dir"):
        assert unsupported_reason(key) is None, key
        cfg = load_config(tmp_path / "empty.yaml", [f"{key}={tmp_path}"])
        assert getattr(cfg.trainer, key.split(".")[1]) == str(tmp_path)
