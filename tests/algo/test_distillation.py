"""On-policy distillation losses (megarl.algo.distillation) against hand-computed values, and the
vocab-parallel student log-probs at the teacher's top-k (megarl.models.topk_logprobs) at TP 2 vs
a dense single-process float64 reference (one two-rank gloo launch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megarl.algo import distillation as d
from megarl.config.schema_distill import DISTILLATION_LOSS_MODES, TOPK_LOSS_MODES
from megarl.models.topk_logprobs import vocab_parallel_log_probs_at
from tests.conftest import run_torchrun

LN2 = math.log(2.0)
WORKER = Path(__file__).with_name("_distill_worker.py")


def lp(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float64)


def test_the_config_offers_exactly_the_modes_the_losses_compute():
    assert set(DISTILLATION_LOSS_MODES) == {*d.TOPK_LOSS_MODES, *d.ESTIMATOR_LOSS_MODES}
    assert TOPK_LOSS_MODES == d.TOPK_LOSS_MODES


def test_forward_kl_topk_by_hand():
    """Teacher top-2 probabilities q = (1/2, 1/4), student p = (1/4, 1/4) at the same ids:
    sum_k q_k (log q_k - log p_k) = 1/2 ln 2 + 1/4 ln 1 = ln2 / 2 (q is not renormalised).
    Student p = (1/2, 1/2): 0 + 1/4 ln(1/2) = -ln2 / 4 < 0, clamped to 0 (the top-k truncation
    makes negative values possible). Gradient w.r.t. the student log-probs: -q (first), and 0
    for the clamped row."""
    s = torch.stack([lp(0.25, 0.25), lp(0.5, 0.5)])[None].requires_grad_(True)  # [1, 2, 2]
    t = torch.stack([lp(0.5, 0.25), lp(0.5, 0.25)])[None]
    loss = d.forward_kl_topk(s, t)
    torch.testing.assert_close(loss, torch.tensor([[LN2 / 2, 0.0]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(
        s.grad[0], torch.tensor([[-0.5, -0.25], [0.0, 0.0]], dtype=torch.float64)
    )


def test_forward_kl_topk_log_prob_floor_by_hand():
    """Floor m = -2: teacher (ln 1/2, -5) -> (ln 1/2, -2), student (ln 1/4, -3) -> (ln 1/4, -2):
    1/2 (ln 1/2 - ln 1/4) + e^-2 (-2 + 2) = ln2 / 2; the floored student entry has no gradient,
    the other -q = -1/2."""
    s = torch.tensor([[[math.log(0.25), -3.0]]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[[math.log(0.5), -5.0]]], dtype=torch.float64)
    loss = d.forward_kl_topk(s, t, log_prob_min_clamp=-2.0)
    assert loss.item() == pytest.approx(LN2 / 2, abs=1e-12)
    loss.sum().backward()
    assert s.grad.tolist() == [[[-0.5, 0.0]]]


def test_topk_overlap_by_hand():
    """Teacher top-2 q = (1/2, 1/4), student p = (1/4, 1/4) at those ids. Position 1: only the
    first id is in the student's own top 2: ratio 1/2, advantage -1/2 (ln 1/2 - ln 1/4) =
    -ln2 / 2. Position 2: both: ratio 1, advantage (-ln2/2 + 0) / 2. Position 3: none: 0 and
    0. With the floor m = ln 1/2 both entries of position 2 floor to ln 1/2: -1/2·0 - 1/2·0 = 0
    (the teacher's 1/4 too)."""
    s = torch.stack([lp(0.25, 0.25)] * 3)[None]
    t = torch.stack([lp(0.5, 0.25)] * 3)[None]
    shared = torch.tensor([[[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]], dtype=torch.float64)
    ratio, advantage = d.topk_overlap(s, t, shared)
    assert ratio.tolist() == [[0.5, 1.0, 0.0]]
    assert advantage[0].tolist() == pytest.approx([-LN2 / 2, -LN2 / 4, 0.0], abs=1e-12)
    _, floored = d.topk_overlap(s, t, shared, log_prob_min_clamp=math.log(0.5))
    assert floored[0].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)


def test_forward_kl_topk_gradient_through_the_full_softmax_by_hand():
    """Vocabulary 3, student logits 0 (p = 1/3 each), teacher top-2 ids (0, 1) with q = (1/2, 1/4),
    m = 3/4: loss = 1/2 ln(3/2) + 1/4 ln(3/4); dL/dz_j = m p_j - q_j 1[j in top-k] =
    (1/4 - 1/2, 1/4 - 1/4, 1/4) = (-1/4, 0, 1/4)."""
    z = torch.zeros(1, 1, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[[0, 1]]])
    s = vocab_parallel_log_probs_at(z, ids, vocab_size=3)
    loss = d.forward_kl_topk(s, lp(0.5, 0.25)[None, None])
    assert loss.item() == pytest.approx(0.5 * math.log(1.5) + 0.25 * math.log(0.75), abs=1e-12)
    loss.sum().backward()
    torch.testing.assert_close(z.grad, torch.tensor([[[-0.25, 0.0, 0.25]]], dtype=torch.float64))


@pytest.mark.parametrize(
    ("mode", "value"),
    [
        ("kl", -LN2),
        ("k1", -LN2),
        ("abs", LN2),
        ("mse", 0.5 * LN2**2),
        ("k2", 0.5 * LN2**2),
        ("low_var_kl", 1 - LN2),
        ("k3", 1 - LN2),
    ],
)
def test_reverse_kl_estimators_by_hand(mode, value):
    """Student p = 1/4, teacher q = 1/2 at the sampled token: d = ln p - ln q = -ln 2.
    k1 = d = -ln2; abs = ln2; k2 = d^2 / 2; k3 = r - ln r - 1 with r = q / p = 2: 1 - ln2."""
    s, t = lp(0.25)[None], lp(0.5)[None]
    got = d.distillation_token_losses(mode, student_log_probs=s, teacher_log_probs=t)
    assert got.item() == pytest.approx(value, abs=1e-12)


def test_loss_max_clamp_clamps_both_ends_and_aggregation_by_hand():
    """k1 = -ln2 ~ -0.693 with loss_max_clamp 0.5: -0.5 (verl clamps to [-c, c]). Two tokens
    (ln2/2 and 0 from the first hand example), the second masked: token-mean = ln2 / 2;
    token-sum of [ln2/2, ln2/2] = ln2."""
    k1 = d.distillation_token_losses(
        "k1", student_log_probs=lp(0.25)[None], teacher_log_probs=lp(0.5)[None], loss_max_clamp=0.5
    )
    assert k1.item() == -0.5
    token = torch.tensor([[LN2 / 2, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0]])
    assert d.distillation_loss(token, mask, "token-mean").item() == pytest.approx(LN2 / 2)
    both = torch.tensor([[LN2 / 2, LN2 / 2]], dtype=torch.float64)
    assert d.distillation_loss(both, torch.ones(1, 2), "token-sum").item() == pytest.approx(LN2)


def test_policy_gradient_advantages_and_the_combination():
    """Advantage = -loss, detached; with task rewards: pg + coef * distill, without: distill."""
    losses = torch.tensor([[0.5, -0.25]], requires_grad=True)
    adv = d.distillation_advantages(losses)
    assert adv.tolist() == [[-0.5, 0.25]] and not adv.requires_grad
    pg, dl = torch.tensor(2.0), torch.tensor(3.0)
    assert d.combined_loss(
        pg, dl, use_task_rewards=True, distillation_loss_coef=0.1
    ).item() == pytest.approx(2.3)
    assert d.combined_loss(pg, dl, use_task_rewards=False, distillation_loss_coef=0.1).item() == 3.0


def test_a_mode_without_its_inputs_is_refused():
    with pytest.raises(ValueError, match="top-k log-probs"):
        d.distillation_token_losses(
            "forward_kl_topk", student_log_probs=lp(0.5)[None], teacher_log_probs=lp(0.5)[None]
        )
    with pytest.raises(ValueError, match="unknown reverse-KL"):
        d.reverse_kl_estimate(lp(0.5)[None], lp(0.5)[None], "full")


def test_log_probs_at_ids_match_log_softmax_at_tp1_with_padding_and_repeats():
    """TP 1 (no group): padded columns masked, repeated ids' gradients accumulate (float64)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    logits[..., 12:] = 1e4
    ids = torch.randint(0, 12, (2, 5, 4), generator=g)
    ids[0, 0] = torch.tensor([3, 3, 3, 7])
    w = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    a = logits.clone().requires_grad_(True)
    (
        vocab_parallel_log_probs_at(a, ids, vocab_size=12, temperature=0.7, chunk=2) * w
    ).sum().backward()
    b = logits[..., :12].clone().requires_grad_(True)
    ref = torch.log_softmax(b / 0.7, -1).gather(-1, ids)
    (ref * w).sum().backward()
    torch.testing.assert_close(a.grad[..., :12], b.grad, rtol=0, atol=1e-12)
    assert a.grad[..., 12:].abs().max() == 0


@pytest.mark.multirank
def test_tp2_vocab_parallel_losses_and_grads_equal_a_dense_float64_reference(tmp_path):
    """forward_kl_topk (plain, and with both clamps at temperature 0.7) and the k3, k1, k2
    estimators, each aggregated by a different loss_agg_mode: the loss and every rank's logit
    gradient within 1e-6 of log_softmax over the gathered, trimmed vocabulary. Without the TP
    reduction (each rank on its shard alone) they are far off: the check can fail."""
    out = tmp_path / "distill.json"
    run_torchrun(WORKER, 2, [str(out)], timeout=300)
    results = json.loads(out.read_text())
    assert len(results) == 5
    for name, r in results.items():
        assert r["loss"] <= 1e-6 and r["grad"] <= 1e-6, (name, r)
        assert r["grad_scale"] > 1e-3 and r["loss_value"] != 0, (name, r)
        assert r["unreduced"] > 1e-3, (name, r)
