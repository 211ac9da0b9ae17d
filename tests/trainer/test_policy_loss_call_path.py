"""The actor's loss through the trainer's own call path (config → `policy_update` → `policy_loss`):
each loss mode's settings reach the loss, and the inputs a loss needs are supplied."""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.algo import get_policy_loss, micro_batch_generator
from megarl.config import BatchPlan, load_config
from megarl.trainer.losses import Counts, policy_loss
from megarl.trainer.setup import policy_update

GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"
ACTOR = "actor_rollout_ref.actor"


def _settings(*overrides: str):
    cfg = load_config(GRPO, list(overrides))
    return policy_update(cfg, BatchPlan.from_config(cfg)), cfg


def _micro_batch(width: int = 6):
    g = torch.Generator().manual_seed(0)
    log_prob = torch.randn(4, width, generator=g) * 0.3 - 1.0
    mb = {
        "old_log_probs": log_prob + 0.2 * torch.randn(4, width, generator=g),
        "advantages": torch.randn(4, width, generator=g),
        "response_mask": torch.ones(4, width),
    }
    mb["ref_log_probs"] = mb["old_log_probs"].clone()
    mb["response_mask"][0, 3:] = 0
    outputs = {"log_probs": log_prob.requires_grad_(), "entropy": torch.rand(4, width, generator=g)}
    return outputs, mb


def _loss(settings, tokens, seqs, outputs, mb, generator=None, teacher=None):
    """The micro-batch loss as the trainer's update computes it (``megarl.trainer.update``)."""
    counts = Counts.of(settings.loss_agg_mode, tokens, seqs, settings.loss_scale_factor)
    return policy_loss(
        settings,
        counts,
        log_prob=outputs["log_probs"],
        entropy=outputs["entropy"],
        old_log_prob=mb["old_log_probs"],
        advantages=mb["advantages"],
        response_mask=mb["response_mask"],
        ref_log_prob=mb["ref_log_probs"],
        generator=generator,
        teacher_log_prob=teacher,
    )


def test_sapo_taus_reach_the_loss():
    outputs, mb = _micro_batch()
    losses = []
    for taus in (("1.0", "1.05"), ("0.3", "2.0")):
        settings, _ = _settings(
            f"{ACTOR}.policy_loss.loss_mode=sapo",
            f"{ACTOR}.tau_pos={taus[0]}",
            f"{ACTOR}.tau_neg={taus[1]}",
        )
        _, metrics = _loss(settings, 23.0, 4.0, outputs, mb)
        loss = metrics["pg_loss"]
        want, _ = get_policy_loss("sapo")(
            old_log_prob=mb["old_log_probs"],
            log_prob=outputs["log_probs"],
            advantages=mb["advantages"],
            response_mask=mb["response_mask"],
            tau_pos=float(taus[0]),
            tau_neg=float(taus[1]),
            global_seq_count=4.0,
        )
        torch.testing.assert_close(loss, want.detach())
        losses.append(loss)
    assert not torch.allclose(losses[0], losses[1])


def test_clip_cov_runs_with_the_trainers_generator():
    outputs, mb = _micro_batch()
    settings, _ = _settings(
        f"{ACTOR}.policy_loss.loss_mode=clip_cov", f"{ACTOR}.policy_loss.clip_cov_ratio=0.2"
    )
    loss, metrics = _loss(settings, 23.0, 4.0, outputs, mb, lambda: micro_batch_generator(1, 2, 0))
    loss.backward()
    assert torch.isfinite(loss) and outputs["log_probs"].grad is not None
    assert "pg_loss" in metrics


def test_dr_grpo_normaliser_is_the_response_length_not_the_batch_width():
    """seq-mean-token-sum-norm without loss_scale_factor divides by the (constant) response
    length as verl does, never by this micro-batch's padded width."""
    settings, cfg = _settings(f"{ACTOR}.loss_agg_mode=seq-mean-token-sum-norm")
    length = cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length
    assert settings.loss_scale_factor == float(length)
    assert length != 6
    outputs, mb = _micro_batch(width=6)
    _, metrics = _loss(settings, 23.0, 4.0, outputs, mb)
    want, _ = get_policy_loss("vanilla")(
        old_log_prob=mb["old_log_probs"],
        log_prob=outputs["log_probs"],
        advantages=mb["advantages"],
        response_mask=mb["response_mask"],
        loss_agg_mode="seq-mean-token-sum-norm",
        global_token_count=23.0,
        global_seq_count=4.0,
        loss_scale_factor=float(length),
    )
    torch.testing.assert_close(metrics["pg_loss"], want.detach())


def test_critic_is_built_with_its_recompute_settings(monkeypatch):
    """critic.megatron.recompute_* reach the critic's build (they were accepted and dropped)."""
    from megarl.trainer import setup

    seen = {}

    def fake_build(path, layout, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop")

    cfg = load_config(
        GRPO.with_name("ppo_tiny_cpu.yaml"),
        [
            "critic.megatron.recompute_granularity=full",
            "critic.megatron.recompute_method=uniform",
            "critic.megatron.recompute_num_layers=1",
        ],
    )
    monkeypatch.setattr(setup, "build_model", fake_build)
    layout = cfg.critic.megatron.parallel_layout()
    try:
        setup._build_critic(cfg, layout, "unused", torch.float32, 1, None)
    except RuntimeError:
        pass
    assert seen["recompute"] == setup.Recompute("full", "uniform", 1)


def test_lr_warmup_init_reaches_the_optimizer_settings():
    """optim.lr_warmup_init (actor and critic) is where the warm-up starts, as in verl's Megatron
    scheduler (tests/models/test_trainable.py checks the schedule itself)."""
    from megarl.trainer.setup import optimizer_settings

    cfg = load_config(GRPO.with_name("ppo_tiny_cpu.yaml"), [
        f"{ACTOR}.optim.lr_warmup_init=1e-7", "critic.optim.lr_warmup_init=2e-7",
    ])  # fmt: skip
    assert optimizer_settings(cfg, 10).lr_warmup_init == 1e-7
    assert optimizer_settings(cfg, 10, "critic").lr_warmup_init == 2e-7


DISTILL = "distillation.distillation_loss"


def _distill_loss(settings, outputs, mb, teacher):
    return _loss(settings, 7.0, 3.0, outputs, mb, teacher=teacher)


def test_distillation_loss_reaches_the_actors_loss_as_verl_combines_it():
    """distillation.* through policy_update into the actor's loss (issue 57): supervised k3
    without the task rewards is the token-mean of k3(student, teacher) alone (by hand:
    r - log r - 1 with r = exp(teacher - student), over this micro-batch's share of 7 tokens), its
    gradient that of the formula; with the task rewards, pg + entropy terms + coef x that; with
    the policy gradient, PPO's vanilla clipped loss with advantage -k1 and the distillation
    section's clip ratios; no teacher log-probs is an error."""
    outputs, mb = _micro_batch()
    g = torch.Generator().manual_seed(5)
    teacher = outputs["log_probs"].detach() + 0.3 * torch.randn(4, 6, generator=g)
    on = ["distillation.enabled=true", f"{DISTILL}.loss_mode=k3"]
    alone, _ = _settings(*on, f"{DISTILL}.use_task_rewards=false")
    assert alone.distillation is not None and alone.distillation.loss_mode == "k3"
    loss, metrics = _distill_loss(alone, outputs, mb, teacher)
    s = outputs["log_probs"]
    mask = mb["response_mask"]
    log_r = teacher - s
    by_hand = ((log_r.exp() - log_r - 1) * mask).sum() / 7.0
    assert torch.allclose(loss, by_hand, atol=1e-6)
    assert torch.allclose(metrics["distillation/loss"], by_hand.detach(), atol=1e-6)
    (grad,) = torch.autograd.grad(loss, s)
    assert torch.allclose(grad, (1 - log_r.exp()) * mask / 7.0, atol=1e-6)

    plain, _ = _settings()
    assert plain.distillation is None
    task, _ = _distill_loss(plain, outputs, mb, None)
    both, _ = _settings(
        *on, f"{DISTILL}.use_task_rewards=true", f"{DISTILL}.distillation_loss_coef=0.5"
    )
    combined, _ = _distill_loss(both, outputs, mb, teacher)
    assert torch.allclose(combined, task + 0.5 * by_hand, atol=1e-6)

    pg, _ = _settings("distillation.enabled=true", f"{DISTILL}.loss_mode=k1",
                      f"{DISTILL}.use_policy_gradient=true", f"{DISTILL}.use_task_rewards=false",
                      f"{DISTILL}.clip_ratio_high=0.28")  # fmt: skip
    loss, _ = _distill_loss(pg, outputs, mb, teacher)
    adv = -(s - teacher).detach()  # k1 = student - teacher
    ratio = (s - mb["old_log_probs"]).exp()
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 0.2, 1 + 0.28))
    dual = torch.where(adv < 0, torch.minimum(surrogate, -adv * 3.0), surrogate)
    assert torch.allclose(loss, (dual * mask).sum() / 7.0, atol=1e-6)
    try:
        _distill_loss(alone, outputs, mb, None)
    except ValueError as exc:
        assert "teacher's log-probs" in str(exc)
    else:
        raise AssertionError("no teacher log-probs must be refused")
