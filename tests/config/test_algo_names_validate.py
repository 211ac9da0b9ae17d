"""Every algorithm name of verl 0.9.1 that megarl runs is accepted by `megarl config validate`, with
the keys its loss or estimator needs; a missing key is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config import ConfigError, load_config, validate

GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"
ACTOR = "actor_rollout_ref.actor"

ACCEPTED = [
    ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,format]"],
    ["algorithm.adv_estimator=optimal_token_baseline", f"{ACTOR}.calculate_sum_pi_squared=true"],
    ["algorithm.adv_estimator=tir_optimal_token_baseline",
     f"{ACTOR}.calculate_sum_pi_squared=true"],
    [f"{ACTOR}.loss_agg_mode=token-sum"],
    [f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.kl_loss_type=k2+"],
    [f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.kl_loss_type=mse+"],
    ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k2+"],
    [f"{ACTOR}.policy_loss.loss_mode=dro", f"{ACTOR}.policy_loss.dro_beta=0.1"],
    [f"{ACTOR}.policy_loss.loss_mode=sapo", f"{ACTOR}.tau_pos=1.0", f"{ACTOR}.tau_neg=1.05"],
    [f"{ACTOR}.policy_loss.loss_mode=kl_cov", f"{ACTOR}.policy_loss.kl_cov_ratio=0.002",
     f"{ACTOR}.policy_loss.ppo_kl_coef=1.0"],
    [f"{ACTOR}.policy_loss.loss_mode=clip_cov", f"{ACTOR}.policy_loss.clip_cov_ratio=0.001",
     f"{ACTOR}.policy_loss.clip_cov_lb=1.0", f"{ACTOR}.policy_loss.clip_cov_ub=5.0"],
] + [
    [f"{ACTOR}.policy_loss.loss_mode={mode}"]
    for mode in ("gspo", "cispo", "geo_mean", "dppo_tv", "dppo_kl")
]  # fmt: skip


@pytest.mark.parametrize("overrides", ACCEPTED, ids=lambda o: " ".join(o))
def test_new_names_are_accepted(overrides):
    validate(load_config(GRPO, overrides), 2)


def test_the_command_line_accepts_them(capsys):
    args = ["config", "validate", "--config", str(GRPO), "--world-size", "2",
            f"{ACTOR}.policy_loss.loss_mode=cispo", "algorithm.adv_estimator=gdpo",
            "algorithm.gdpo_reward_keys=[acc]"]  # fmt: skip
    assert main(args) == 0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([f"{ACTOR}.policy_loss.loss_mode=dro"], f"{ACTOR}.policy_loss.dro_beta"),
        (["algorithm.adv_estimator=optimal_token_baseline"], f"{ACTOR}.calculate_sum_pi_squared"),
        ([f"{ACTOR}.policy_loss.loss_mode=clip_cov", f"{ACTOR}.policy_loss.clip_cov_lb=6"],
         f"{ACTOR}.policy_loss.clip_cov_lb"),
        ([f"{ACTOR}.policy_loss.loss_mode=kl_cov", f"{ACTOR}.policy_loss.kl_cov_ratio=0"],
         f"{ACTOR}.policy_loss.kl_cov_ratio"),
        ([f"{ACTOR}.policy_loss.loss_mode=sapo", f"{ACTOR}.tau_neg=0"], f"{ACTOR}.tau_pos"),
    ],
)  # fmt: skip
def test_a_missing_or_bad_key_is_named(overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        validate(load_config(GRPO, overrides), 2)


def test_sequence_losses_warn_that_loss_agg_mode_is_ignored():
    cfg = load_config(
        GRPO, [f"{ACTOR}.policy_loss.loss_mode=sapo", f"{ACTOR}.loss_agg_mode=seq-mean-token-sum"]
    )
    assert any("ignored by" in w for w in validate(cfg, 2))
    gspo = load_config(
        GRPO, [f"{ACTOR}.policy_loss.loss_mode=gspo", f"{ACTOR}.loss_agg_mode=seq-mean-token-sum"]
    )
    assert not any("ignored by" in w for w in validate(gspo, 2))  # verl 0.9.1 honours it


def test_an_unknown_loss_mode_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        load_config(GRPO, [f"{ACTOR}.policy_loss.loss_mode=grpo_clip"])
    assert "dppo_kl" in str(info.value)


# What each built-in estimator and loss needs from the config besides its name.
_NEEDS = {
    "optimal_token_baseline": [f"{ACTOR}.calculate_sum_pi_squared=true"],
    "tir_optimal_token_baseline": [f"{ACTOR}.calculate_sum_pi_squared=true"],
    "dro": [f"{ACTOR}.policy_loss.dro_beta=0.1"],
    "gdpo": ["algorithm.gdpo_reward_keys=[acc]"],
}


def test_every_built_in_estimator_and_loss_validates():
    """The trainer supplies every input each registered estimator and policy loss declares
    (megarl.config.algo_inputs), so each validates with its own keys."""
    from megarl.algo import ADV_ESTIMATORS, POLICY_LOSSES
    from megarl.config.algo_inputs import unsupplied_inputs

    for name in ADV_ESTIMATORS.names():
        cfg = load_config(GRPO, [f"algorithm.adv_estimator={name}", *_NEEDS.get(name, [])])
        assert unsupplied_inputs(cfg) == [], name
        validate(cfg, 2)
    for name in POLICY_LOSSES.names():
        cfg = load_config(GRPO, [f"{ACTOR}.policy_loss.loss_mode={name}", *_NEEDS.get(name, [])])
        assert unsupplied_inputs(cfg) == [], name
        validate(cfg, 2)


def test_a_declared_input_the_trainer_does_not_supply_is_refused(monkeypatch):
    """An estimator or loss declaring an input outside the trainer's set is refused in one line
    at validation, not found mid-run (nor papered over by a default)."""
    from megarl.algo import ADV_ESTIMATORS, POLICY_LOSSES

    monkeypatch.setitem(ADV_ESTIMATORS._inputs, "rloo", (*ADV_ESTIMATORS.inputs("rloo"), "tau"))
    with pytest.raises(ConfigError) as info:
        validate(load_config(GRPO, ["algorithm.adv_estimator=rloo"]), 2)
    (line,) = [p for p in info.value.problems if "tau" in p]
    assert line == "algorithm.adv_estimator=rloo needs tau, which the trainer does not supply"
    monkeypatch.setitem(POLICY_LOSSES._inputs, "gpg", (*POLICY_LOSSES.inputs("gpg"), "beta"))
    with pytest.raises(ConfigError, match=rf"^{ACTOR}\.policy_loss\.loss_mode=gpg needs beta, wh"):
        validate(load_config(GRPO, [f"{ACTOR}.policy_loss.loss_mode=gpg"]), 2)
    with pytest.raises(ConfigError, match="sum_pi_squared only with .*calculate_sum_pi_squared"):
        validate(load_config(GRPO, ["algorithm.adv_estimator=optimal_token_baseline"]), 2)
