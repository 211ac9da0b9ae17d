"""Registries: every config name from the seeds is present; unknown names list the valid ones."""

from __future__ import annotations

import pytest
import torch

from megarl.algo import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    compute_advantage,
    compute_policy_loss,
    get_adv_estimator,
    get_kl_estimator,
    get_policy_loss,
)

SEED_ESTIMATORS = [
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "grpo_passk",
]


def test_every_seed_name_is_registered():
    for name in SEED_ESTIMATORS:
        assert callable(get_adv_estimator(name))
    for name in ("kl", "abs", "mse", "low_var_kl", "full", "k1", "k2", "k3"):
        assert callable(get_kl_estimator(name))
    assert callable(get_policy_loss("vanilla")) and callable(get_policy_loss("gpg"))


@pytest.mark.parametrize(
    "getter,registry,bad",
    [
        (get_adv_estimator, ADV_ESTIMATORS, "ppo"),
        (get_policy_loss, POLICY_LOSSES, "clip"),
        (get_kl_estimator, KL_ESTIMATORS, "k4"),
    ],
)
def test_unknown_name_lists_valid_names(getter, registry, bad):
    with pytest.raises(ValueError) as err:
        getter(bad)
    message = str(err.value)
    assert repr(bad) in message
    for name in registry.names():
        assert name in message


def test_compute_advantage_unknown_name():
    with pytest.raises(ValueError, match="grpo_passk"):
        compute_advantage("dapo", token_level_rewards=None)


def test_inputs_an_estimator_does_not_declare_are_not_passed():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    # `values` and `gamma` belong to gae / reinforce_plus_plus: grpo does not declare them
    adv, _ = compute_advantage(
        "grpo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=[0, 0],
        norm_adv_by_std_in_grpo=True,
        values=torch.zeros(2, 2),
        gamma=0.9,
    )
    assert adv[:, 0].tolist() == pytest.approx([2**-0.5, -(2**-0.5)], abs=1e-5)


def test_a_declared_input_that_is_not_supplied_is_named():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match=r"'grpo' .* needs response_mask, norm_adv_by_std_in_grpo"):
        compute_advantage(
            "grpo", token_level_rewards=rewards, respons_mask=torch.ones(2, 2), index=[0, 0]
        )
    with pytest.raises(ValueError, match="needs loss_agg_mode, .*, clip_ratio_c, which"):
        compute_policy_loss(
            "vanilla",
            old_log_prob=torch.zeros(1, 1),
            log_prob=torch.zeros(1, 1),
            advantages=torch.ones(1, 1),
            response_mask=torch.ones(1, 1),
            **dict.fromkeys(["clip_ratio", "clip_ratio_low", "clip_ratio_high"], 0.2),
        )


def test_declared_inputs_are_the_functions_parameters():
    """The declarations are what each function takes (checked here, not read at run time):
    an estimator's keyword parameters without defaults are all declared, and every declared
    input is a parameter; a policy loss's settings are its body's parameters after `inputs`."""
    import inspect

    for name in ADV_ESTIMATORS.names():
        params = inspect.signature(get_adv_estimator(name)).parameters
        declared = ADV_ESTIMATORS.inputs(name)
        assert set(declared) <= set(params), name
        required = {k for k, p in params.items() if p.default is inspect.Parameter.empty}
        assert required <= set(declared), name
    for name in POLICY_LOSSES.names():
        loss = get_policy_loss(name)
        body = list(inspect.signature(loss.body).parameters)
        assert body[0] == "inputs" and tuple(body[1:]) == loss.settings, name
        assert POLICY_LOSSES.inputs(name) == loss.inputs, name


def test_every_policy_loss_runs_with_the_trainers_inputs():
    """The trainer supplies one set of inputs (config keys and batch fields) whatever the loss
    mode; each loss is given what it declares."""
    from megarl.algo import micro_batch_generator
    from megarl.config import POLICY_LOSS_MODES
    from tests.algo._reference import policy_batch

    old, new, adv, mask = policy_batch(0)
    inputs = {
        "old_log_prob": old, "log_prob": new, "advantages": adv, "response_mask": mask,
        "rollout_is_weights": torch.ones(5, 6), "loss_agg_mode": "token-mean",
        "global_token_count": mask.sum(), "global_seq_count": 4.0, "loss_scale_factor": None,
        "seq_token_counts": mask.sum(-1), "clip_ratio": 0.2, "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05,
        "dro_beta": 0.1, "kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1, "clip_cov_ratio": 0.2,
        "clip_cov_lb": 0.0, "clip_cov_ub": 5.0, "generator": micro_batch_generator(0, 1, 2),
    }  # fmt: skip
    assert sorted(POLICY_LOSS_MODES) == POLICY_LOSSES.names()
    for name in POLICY_LOSS_MODES:
        loss, metrics = compute_policy_loss(name, **inputs)
        (grad,) = torch.autograd.grad(loss, new)
        assert loss.dim() == 0 and torch.isfinite(loss) and torch.isfinite(grad).all(), name
        assert grad[3].abs().sum() == 0, name  # the empty row gets no gradient
        assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values()), name
