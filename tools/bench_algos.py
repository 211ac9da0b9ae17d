"""Benchmark megarl.algo against straightforward reference loops (CPU, 2 threads, float32 inputs).

    python tools/bench_algos.py [--repeat 5] [--threads 2]

Cases (sizes from issue 3):
- GAE, B=256, T=4096, gamma=0.99, lam=0.95 and gamma=lam=1, whitened — right-padded masks of
  random length, and masks with interior zeros (multi-turn style: masked 32-token spans) and some
  all-zero rows; float32 masks, and int64 masks ([int64 mask], what the trainer passes);
- GRPO and RLOO, B=1024 in groups of 8, T=1024, float32 and int64 masks;
- the PPO clip policy loss (clip-higher + dual-clip, token-mean), B=256, T=4096.
The references are deliberately plain: a loop over time steps (GAE: `tests/algo/_reference.py`,
shared with the tests; the loss) or over responses and groups (GRPO/RLOO), the way verl's
core_algos computes them. Accuracy is measured
against the same reference evaluated in float64: max |diff| and max |diff| / |ref| (elementwise,
over valid tokens, |ref| > 1e-3 * max|ref|). Times: best and median of `--repeat` runs (10x as
many for megarl, interleaved with the reference's so that both see the same load) after a warm-up;
on a shared machine the best time is the least disturbed one. The speed-up is reference / megarl
for each statistic.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import statistics
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.algo import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_policy_loss_vanilla,
    compute_rloo_outcome_advantage,
)
from tests.algo._reference import gae_recurrence, whiten

# ----------------------------------------------------------------------------- references


def reference_gae(rewards, values, mask, gamma, lam):
    """verl's per-step recurrence in the inputs' dtype, whitened; (advantages, returns)."""
    advantages, returns = gae_recurrence(rewards, values, mask, gamma, lam, dtype=rewards.dtype)
    return whiten(advantages, mask, dtype=rewards.dtype), returns


def reference_group_advantage(rewards, mask, index, kind, epsilon=1e-6):
    """Per-response and per-group Python loops (verl's GRPO / RLOO structure)."""
    scores = rewards.sum(dim=-1)
    by_group = defaultdict(list)
    for i in range(scores.shape[0]):
        by_group[index[i]].append(i)
    out = torch.zeros_like(scores)
    for members in by_group.values():
        group = scores[members]
        n = len(members)
        if n < 2:
            continue
        mean, std = group.mean(), group.std()
        for i in members:
            if kind == "grpo":
                out[i] = (scores[i] - mean) / (std + epsilon)
            else:
                out[i] = (scores[i] * n - group.sum()) / (n - 1)
    return out.unsqueeze(-1) * mask


def reference_policy_loss(old_log_prob, log_prob, advantages, mask, low, high, clip_c):
    """Clipped surrogate computed one time step (column) at a time, token-mean."""
    total = torch.zeros((), dtype=log_prob.dtype)
    for t in range(log_prob.shape[1]):
        log_ratio = torch.clamp(log_prob[:, t] - old_log_prob[:, t], -20.0, 20.0)
        ratio = torch.exp(log_ratio)
        adv = advantages[:, t]
        clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
        dual = torch.minimum(clipped, -adv * clip_c)
        per_token = torch.where(adv < 0, dual, clipped)
        total = total + (per_token * mask[:, t]).sum()
    return total / mask.sum()


# ----------------------------------------------------------------------------- harness


def keep_freed_memory() -> bool:
    """Ask glibc malloc to keep freed memory instead of returning it to the OS.

    By default glibc gives large freed blocks back (munmap, heap trimming), so every call that
    allocates a few [B, T] float64 buffers faults their pages in again: ~2 us per 4 KiB page in
    this VM, i.e. ~8 ms of a 15 ms GAE call. PyTorch's CPU performance guide recommends jemalloc
    or tcmalloc for the same reason. Affects the reference and megarl alike; --no-malloc-tuning
    measures plain glibc.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30))


OURS_REPEAT = 10  # the vectorized code is fast: time it more often than the reference


def timed_pair(reference, ours, repeat):
    """Best and median wall times of `reference` (`repeat` calls) and `ours` (OURS_REPEAT times as
    many), interleaved so that both see the same machine load, after a warm-up of each; and the
    last result of `ours`."""
    reference(), ours()
    ref_times, our_times = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        reference()
        ref_times.append(time.perf_counter() - start)
        for _ in range(OURS_REPEAT):
            start = time.perf_counter()
            result = ours()
            our_times.append(time.perf_counter() - start)
    stats = lambda times: (min(times), statistics.median(times))
    return stats(ref_times), stats(our_times), result


def errors(ours: torch.Tensor, ref64: torch.Tensor, mask: torch.Tensor | None):
    ours = ours.double()
    diff = (ours - ref64).abs()
    scale = ref64.abs()
    keep = scale > 1e-3 * scale.max().clamp(min=1e-30)
    if mask is not None:
        diff = diff * mask
        keep = keep & mask.bool()
    rel = (diff / scale.clamp(min=1e-30))[keep]
    return diff.max().item(), (rel.max().item() if rel.numel() else 0.0)


def make_masks(batch, length, generator, interior):
    lengths = torch.randint(length // 8, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    if interior:
        # multi-turn style: 32-token spans (tool observations) masked out inside the response
        # with probability 0.3, and every 8th row empty
        span = 32
        keep = torch.rand(batch, length // span, generator=generator) > 0.3
        mask = mask * keep.repeat_interleave(span, dim=1).float()
        mask[:: batch // 8] = 0.0
    return mask


def bench_gae(repeat, generator):
    """GAE with float32 masks and with int64 masks (the trainer's)."""
    rows = []
    batch, length = 256, 4096
    for interior in (False, True):
        mask = make_masks(batch, length, generator, interior)
        rewards = torch.randn(batch, length, generator=generator) * mask
        values = torch.randn(batch, length, generator=generator)
        for gamma, lam in ((0.99, 0.95), (1.0, 1.0)):
            adv64, ret64 = reference_gae(
                rewards.double(), values.double(), mask.double(), gamma, lam
            )
            for suffix, our_mask in (("", mask), (" [int64 mask]", mask.long())):
                ref_t, ours_t, (adv, ret) = timed_pair(
                    partial(reference_gae, rewards, values, mask, gamma, lam),
                    partial(
                        compute_gae_advantage_return,
                        rewards,
                        values,
                        our_mask,
                        gamma=gamma,
                        lam=lam,
                    ),
                    repeat,
                )
                adv_abs, adv_rel = errors(adv, adv64, mask)
                ret_abs, ret_rel = errors(ret, ret64, mask)
                masks = "interior zeros" if interior else "right-padded"
                name = f"GAE g={gamma} l={lam} {masks}{suffix}"
                rows.append((name, ref_t, ours_t, max(adv_abs, ret_abs), max(adv_rel, ret_rel)))
    return rows


def bench_groups(repeat, generator):
    rows = []
    batch, length, group = 1024, 1024, 8
    mask = make_masks(batch, length, generator, interior=False)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()
    scores = (torch.rand(batch, generator=generator) > 0.5).float() + 0.1 * torch.randn(
        batch, generator=generator
    )
    rewards = last.float() * scores[:, None]
    index = torch.arange(batch) // group
    index_list = index.tolist()
    cases = [
        ("grpo", compute_grpo_outcome_advantage, ""),
        ("grpo", compute_grpo_outcome_advantage, " [int64 mask]"),
        ("rloo", compute_rloo_outcome_advantage, ""),
    ]
    for kind, fn, suffix in cases:
        our_mask = mask.long() if suffix else mask
        ref = partial(reference_group_advantage, rewards, mask, index_list, kind)
        ref_t, ours_t, (adv, _) = timed_pair(ref, partial(fn, rewards, our_mask, index), repeat)
        ref64 = reference_group_advantage(rewards.double(), mask.double(), index_list, kind)
        abs_err, rel_err = errors(adv, ref64, mask)
        name = f"{kind.upper()} B={batch} groups of {group}{suffix}"
        rows.append((name, ref_t, ours_t, abs_err, rel_err))
    return rows


def bench_policy_loss(repeat, generator):
    batch, length = 256, 4096
    mask = make_masks(batch, length, generator, interior=False)
    old = -torch.rand(batch, length, generator=generator) * 3
    new = old + 0.3 * torch.randn(batch, length, generator=generator)
    adv = torch.randn(batch, length, generator=generator)
    params = {"low": 0.2, "high": 0.28, "clip_c": 3.0}
    ref_t, ours_t, (loss, _) = timed_pair(
        lambda: reference_policy_loss(old, new, adv, mask, **params),
        lambda: compute_policy_loss_vanilla(
            old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0
        ),
        repeat,
    )
    ref64 = reference_policy_loss(old.double(), new.double(), adv.double(), mask.double(), **params)
    abs_err, rel_err = errors(loss.reshape(1), ref64.reshape(1), None)
    return [(f"policy loss B={batch} T={length}", ref_t, ours_t, abs_err, rel_err)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-malloc-tuning", action="store_true", help="leave glibc malloc at its defaults"
    )
    args = parser.parse_args()
    tuned = False if args.no_malloc_tuning else keep_freed_memory()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)

    rows = bench_gae(args.repeat, generator)
    rows += bench_groups(args.repeat, generator)
    rows += bench_policy_loss(args.repeat, generator)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 inputs, glibc malloc "
        f"{'keeps freed memory' if tuned else 'defaults'}; times: best and median of "
        f"{args.repeat} runs (megarl: {OURS_REPEAT * args.repeat}); errors vs the reference "
        "evaluated in float64"
    )
    header = (
        f"{'case':<46} {'ref best ms':>11} {'ours best ms':>12} {'speed-up':>9} "
        f"{'(median)':>9} {'max|diff|':>10} {'max rel':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, (ref_best, ref_median), (ours_best, ours_median), abs_err, rel_err in rows:
        print(
            f"{name:<46} {ref_best * 1e3:>11.1f} {ours_best * 1e3:>12.2f} "
            f"{ref_best / ours_best:>8.1f}x {ref_median / ours_median:>8.1f}x "
            f"{abs_err:>10.2e} {rel_err:>9.2e}"
        )


if __name__ == "__main__":
    main()
