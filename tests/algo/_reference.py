"""Plain per-step / per-group reference implementations (float64) the vectorized code is tested
against. They follow verl's `core_algos.py` loops in behaviour; written independently."""

from __future__ import annotations

from collections import defaultdict

import torch


def gae_recurrence(rewards, values, mask, gamma, lam, dtype=torch.float64):
    """verl's per-step GAE: masked steps carry `nextvalues` and `lastgaelam` unchanged.

    Returns raw (un-whitened) advantages and returns = advantages + values, in `dtype` (float64;
    `tools/bench_algos.py` times it in the inputs' dtype)."""
    r, v, m = rewards.to(dtype), values.to(dtype), mask.to(dtype)
    batch, length = r.shape
    nextvalues = torch.zeros(batch, dtype=dtype)
    lastgaelam = torch.zeros(batch, dtype=dtype)
    out = torch.zeros(batch, length, dtype=dtype)
    for t in reversed(range(length)):
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        candidate = delta + gamma * lam * lastgaelam
        nextvalues = v[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = candidate * m[:, t] + (1 - m[:, t]) * lastgaelam
        out[:, t] = lastgaelam
    return out, out + v


def linear_recurrence(x, factors):
    """y[t] = x[t] + factors[t] * y[t+1], y[T] = 0, float64."""
    x, a = x.double(), factors.double()
    y = torch.zeros_like(x)
    running = torch.zeros(x.shape[0], dtype=torch.float64)
    for t in reversed(range(x.shape[1])):
        running = x[:, t] + a[:, t] * running
        y[:, t] = running
    return y


def reinforce_plus_plus_returns(rewards, mask, gamma):
    """verl 0.9.1's REINFORCE++ loop, one step and one row at a time: a valid step discounts and
    adds its reward; a masked step leaves the running return as it is and has return 0."""
    returns = torch.zeros(rewards.shape, dtype=torch.float64)
    for i in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[i, t]:
                running = float(rewards[i, t]) + gamma * running
                returns[i, t] = running
    return returns


def whiten(values, mask, dtype=torch.float64):
    """masked whitening with unbiased variance (verl's masked_whiten), in `dtype`."""
    v, m = values.to(dtype), mask.to(dtype)
    n = m.sum()
    mean = (v * m).sum() / n
    var = (((v - mean) ** 2) * m).sum() / (n - 1)
    return (v - mean) / torch.sqrt(var + 1e-8)


def groups(index):
    members = defaultdict(list)
    for i, label in enumerate(index):
        members[label].append(i)
    return list(members.values())


def group_scalars(scores, index, rule):
    """Apply rule(scores_of_group, position_in_group) per group; groups of one get 0."""
    scores = scores.double()
    out = torch.zeros_like(scores)
    for members in groups(index):
        if len(members) < 2:
            continue
        group = scores[members]
        for k, i in enumerate(members):
            out[i] = rule(group, k)
    return out


MASK = [
    [1, 1, 1, 1, 1, 1],
    [1, 1, 0, 1, 0, 0],  # interior zero, then padding
    [1, 0, 0, 0, 0, 0],  # one token
    [0, 0, 0, 0, 0, 0],  # empty row
    [1, 1, 1, 0, 1, 1],  # interior zero
]


def policy_batch(seed, sequence_advantages=False, zero_advantage=True):
    """(old_log_prob, log_prob (requires grad), advantages, mask) `[5, 6]` float32: ragged rows,
    interior zeros, an empty row; log-ratios up to ~+-0.8 (some clipped at 0.2), advantages of both
    signs with some zeros."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor(MASK, dtype=torch.float32)
    old = -0.05 - 2.5 * torch.rand(5, 6, generator=g)
    new = (old + 0.5 * torch.randn(5, 6, generator=g)).clamp(max=-0.01)
    if sequence_advantages:
        adv = torch.randn(5, 1, generator=g).expand(5, 6).clone()
    else:
        adv = torch.randn(5, 6, generator=g)
        if zero_advantage:
            adv[0, 2] = 0.0
    return old, new.requires_grad_(True), adv, mask


def token_mean(per_token, mask):
    """(loss, d loss / d per-token value) of token-mean aggregation, by a loop, float64."""
    n = sum(1 for row in mask.tolist() for m in row if m)
    loss = sum(
        per_token[i][t] for i, row in enumerate(mask.tolist()) for t, m in enumerate(row) if m
    )
    return loss / n, 1.0 / n
