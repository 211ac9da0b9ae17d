"""Generalized Advantage Estimation (PPO's `adv_estimator: gae`), vectorized, float64 inside.

Reproduces every valid position of verl's backward recurrence, which starts from
`nextvalues = lastgaelam = 0` and skips masked steps (they update nothing):

    delta[t] = r[t] + gamma * nextvalues - V[t];   A[t] = delta[t] + gamma * lam * lastgaelam

Masked positions get advantage 0 and returns = values (verl differs only at interior and leading
masked steps, which never reach a loss). Whitening, as verl's `masked_whiten`, takes the masked
mean and unbiased variance over valid tokens and applies them to every position.
"""

from __future__ import annotations

import math

import torch

from megarl.algo.registry import ADV_ESTIMATORS
from megarl.algo.scan import discounted_reverse_cumsum, exclusive_cumsum
from megarl.algo.token_advantages import _check_unit_interval

_F64 = torch.float64
# Below this lam the folded form's V / lam terms cost precision (error grows like 1 / lam).
_MIN_LAMBDA = 0.01
# Weights inside one block span at most this factor. Reverse sums are differences of forward sums
# of weighted terms, so their rounding error relative to the result grows with it (64 * 1e-16).
_MAX_GROWTH = 64.0
# Up to this many blocks per row are joined by a weighted cumulative sum, more by doubling.
_MAX_DIRECT_BLOCKS = 256
# Elements per chunk: a handful of float64 buffers of this size stay in the CPU's last-level cache
# (2 MiB each), while the per-operation overhead of a chunk stays small.
_CHUNK_ELEMENTS = 1 << 18


@ADV_ESTIMATORS.register(
    "gae", inputs=("token_level_rewards", "values", "response_mask", "gamma", "lam")
)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns for PPO (see the module docstring for the exact semantics).

    Computed in float64 and rounded once to the input dtype; lam < _MIN_LAMBDA (the fast route
    divides by lam) and gamma = 0 take the direct route.

    Args:
        token_level_rewards: `[B, T]` rewards per response token.
        values: `[B, T]` critic values V(s_t).
        response_mask: `[B, T]` binary (bool, int or 0./1.): 1 for tokens that count, anywhere in
            the row (right padding, prompt prefixes and interior spans such as tool output).
        gamma: discount factor (`algorithm.gamma`), in [0, 1].
        lam: GAE lambda (`algorithm.lam`), in [0, 1].
        whiten: whiten the advantages over the valid tokens (verl always does).

    Returns:
        advantages `[B, T]` (whitened if `whiten`), returns `[B, T]` = raw advantages + values; in
        the dtype of `values`. A non-binary mask raises ValueError.
    """
    gamma, lam = _checked(token_level_rewards, values, response_mask, gamma, lam)
    if values.numel() == 0:
        return torch.zeros_like(values), values.clone()
    if lam < _MIN_LAMBDA or gamma == 0.0:
        return _gae_direct(token_level_rewards, values, response_mask, gamma, lam, whiten)
    return _gae_folded(token_level_rewards, values, response_mask, gamma, lam, whiten)


def _checked(rewards, values, mask, gamma, lam) -> tuple[float, float]:
    """(gamma, lam) as floats, after checking them and the shapes."""
    if not rewards.shape == values.shape == mask.shape:
        raise ValueError(
            "token_level_rewards, values and response_mask must have one shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if values.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got shape {tuple(values.shape)}")
    _check_unit_interval(gamma=gamma, lam=lam)
    return float(gamma), float(lam)


def _gae_folded(rewards, values, mask, gamma, lam, whiten):
    """The fast route (lam >= _MIN_LAMBDA, gamma > 0): chunks of rows, float64 inside.

    With d = gamma * lam the recurrence is A[t] = a[t] * A[t+1] + m[t] * delta[t], a[t] = d at
    valid and 1 at masked steps. Folding the next-value term into the scan,
    X[t] = m[t] * (r[t] - V[t] + V[t] / lam) and A[t] = m[t] * (r[t] - V[t]) + d * S[t+1] with S
    the reverse scan of X, so no "next valid value" is ever looked up (`_chunk_advantages`). On
    CPU this is memory-bound (16 bytes per element per pass over a float64 `[B, T]` tensor):
    rows go in chunks of cache-sized buffers and the code counts passes.
    """
    B, T = values.shape
    blocks = _Blocks(gamma * lam, T, values.device)
    step = max(1, _CHUNK_ELEMENTS // blocks.width)
    # Raw advantages stay in float64 until the whitening statistics are known; the other work
    # buffers are reused by every chunk, so that they stay in cache. Columns past T hold 0.
    raw = values.new_empty(B, blocks.width, dtype=_F64)
    work = [values.new_empty(min(step, B), blocks.width, dtype=_F64) for _ in range(4)]
    for buffer in (raw, *work):
        buffer[:, T:] = 0.0
    advantages, returns = torch.empty_like(values), torch.empty_like(values)
    count = total = total_sq = 0.0
    for lo in range(0, B, step):
        hi = min(lo + step, B)
        R = raw[lo:hi]
        V, M, X, W = (buffer[: hi - lo] for buffer in work)
        # The mask is taken as given (bool, int64 or float) and converted chunk by chunk, while
        # copied into the float64 buffer: no full-size conversion pass.
        R[:, :T].copy_(rewards[lo:hi]), V[:, :T].copy_(values[lo:hi]), M[:, :T].copy_(mask[lo:hi])
        chunk_count, right_padded = _mask_rows(M)
        count += chunk_count
        _chunk_advantages(R, V, M, X, W, lam, blocks, right_padded)
        returns[lo:hi].copy_(V[:, :T])
        flat = R.view(-1)
        total += float(flat.sum())
        total_sq += float(torch.dot(flat, flat))
    if not whiten:
        return advantages.copy_(raw[:, :T]), returns
    mean, scale = _whitening(total, total_sq, count)
    for lo in range(0, B, step):
        advantages[lo : lo + step].copy_(raw[lo : lo + step, :T].sub_(mean).mul_(scale))
    return advantages, returns


def _mask_rows(mask: torch.Tensor) -> tuple[float, bool]:
    """(number of valid tokens, whether every row is right-padded) of a float64 `[b, n]` mask.

    Raises ValueError when the mask holds anything but 0 and 1.
    """
    counts = mask.sum(dim=-1)
    if not torch.equal((mask * mask).sum(dim=-1), counts):
        raise ValueError("response_mask must be binary: 0/1 (float, int) or bool")
    positions = mask @ torch.arange(mask.shape[1], dtype=_F64, device=mask.device)
    # n ones sit at 0..n-1 exactly when their positions sum to n(n-1)/2, the least possible.
    right_padded = bool((positions == counts * (counts - 1) * 0.5).all())
    return float(counts.sum()), right_padded


class _Blocks:
    """Rows of T steps cut into `n` blocks of `length` (the last padded with masked steps), and
    what every chunk shares: the weights d**1 .. d**length of a block where every step decays and
    the matrices that join the blocks."""

    def __init__(self, d: float, T: int, device) -> None:
        self.d = d
        if d == 1.0:
            self.length = T
        else:  # a power of two with d**-length <= _MAX_GROWTH
            steps = max(1.0, math.log(_MAX_GROWTH) / -math.log(d))
            self.length = min(1 << int(math.log2(steps)), T)
            k = torch.arange(1, self.length + 1, dtype=_F64, device=device)
            self.powers = torch.exp(k * math.log(d))
            self.inverse_powers = torch.exp(k * -math.log(d))
        self.n = -(-T // self.length)
        self.width = self.n * self.length
        # Joining by matrices needs few blocks and, for running products, no underflow: any
        # product of factors is at least d**T.
        self.direct = 1 < self.n <= _MAX_DIRECT_BLOCKS and T * -math.log(d) < 600.0
        if self.direct:
            k = torch.arange(self.n, dtype=_F64, device=device)
            gap = k[:, None] - k[None, :]
            self.later = (gap >= 0).to(_F64)  # later[c, k] = 1 for blocks c >= k
            rate = self.length * math.log(d)
            self.decayed = torch.exp(gap.clamp(min=0) * rate) * self.later  # (d**length)**(c-k)


def _chunk_advantages(R, V, M, X, W, lam: float, blocks: _Blocks, right_padded: bool) -> None:
    """One chunk, in place on float64 `[b, n * blocks.length]` rows, zero past the data.

    In: R, V, M hold rewards, values and the mask. Out: R the raw advantages, V the returns.
    X and W are scratch. With x = m (r - V + V / lam) and weights w[j] = running product of the
    factors inside each block, F = cumsum(w x) per block and the weighted sum of x over i > j is
    G' - F[j], G' being the block total plus what flows in from the later blocks. Then
    A[j] = m (r - V)[j] + d * S[j + 1] = m (r - V)[j] + (G' - F[j]) / w[j] for valid j.
    """
    b = R.shape[0]
    d, length, n = blocks.d, blocks.length, blocks.n
    R.sub_(V).mul_(M)  # m (r - V): delta without its next-value term
    torch.addcmul(R, M, V, value=1.0 / lam, out=X)
    x = X.view(b, n, length)
    if d == 1.0:
        weights = None
    elif right_padded:  # every step decays (x is 0 on the padding): one row of powers
        weights = blocks.powers
    else:
        weights = torch.mul(M, d - 1.0, out=W).add_(1.0).view(b, n, length).cumprod_(-1)
    if weights is not None:
        x.mul_(weights)
    x.cumsum_(-1)
    if n == 1:
        tails = x[:, :, -1:].clone()
    elif right_padded and blocks.direct:
        tails = (x[:, :, -1] @ blocks.decayed)[:, :, None]
    else:
        ends = weights[:, :, -1] if not right_padded else x.new_full((b, n), d**length)
        tails = _chain_blocks(x[:, :, -1].clone(), ends, blocks)[:, :, None]
    torch.sub(tails, x, out=x)  # G' - F[j]
    if weights is None:
        R.add_(X) if right_padded else R.addcmul_(X, M)
    elif right_padded:
        R.view(b, n, length).addcmul_(x, blocks.inverse_powers)
    else:
        x.div_(weights)
        R.addcmul_(X, M)  # masked positions keep 0
    V.add_(R)


def _chain_blocks(totals: torch.Tensor, ends: torch.Tensor, blocks: _Blocks) -> torch.Tensor:
    """`tails[:, k] = totals[:, k] + ends[:, k] * tails[:, k + 1]` over the block axis of `[b, n]`.

    `ends[:, k]` is block k's product of factors. With P[k] the product of ends before block k,
    tails[k] = sum_{c >= k} P[c] totals[c] / P[k] (one small matrix product); by doubling
    (log2 n steps) when the blocks are many or the products could underflow.
    """
    if blocks.direct:
        P = torch.ones_like(totals)
        torch.cumprod(ends[:, :-1], dim=-1, out=P[:, 1:])
        return ((P * totals) @ blocks.later).div_(P)
    tails, factors = totals, ends.clone()
    step = 1
    while step < blocks.n:  # doubling: compose each (factor, tail) with the one `step` later
        tails_next = torch.addcmul(tails[:, :-step], factors[:, :-step], tails[:, step:])
        factors_next = factors[:, :-step] * factors[:, step:]
        tails[:, :-step], factors[:, :-step] = tails_next, factors_next
        step *= 2
    return tails


def _whitening(total: float, total_sq: float, count: float) -> tuple[float, float]:
    """(mean, 1 / sqrt(unbiased var + 1e-8)) of values with the given sum, square sum and count."""
    mean = total / count if count > 0 else 0.0
    var = max(total_sq - count * mean * mean, 0.0) / (count - 1) if count > 1 else 0.0
    return mean, 1.0 / math.sqrt(var + 1e-8)


def _gae_direct(rewards, values, mask, gamma, lam, whiten):
    """lam < _MIN_LAMBDA or gamma = 0: delta with an explicit next-valid-value lookup, then the
    masked reverse scan of `scan.py` (a loop over few blocks at most). Slower, rarely used."""
    r, v, m = rewards.to(_F64), values.to(_F64), mask.to(_F64)
    _mask_rows(m)  # raises on a non-binary mask
    valid = m != 0
    delta = (r - v + gamma * _next_valid_values(v, valid)) * m
    d = gamma * lam
    adv = delta if d == 0.0 else discounted_reverse_cumsum(delta, d, exclusive_cumsum(valid))
    adv = adv * m
    returns = (adv + v).to(values.dtype)
    if whiten:
        count = float(m.sum())
        mean, scale = _whitening(float(adv.sum()), float((adv * adv).sum()), count)
        adv = (adv - mean) * scale
    return adv.to(values.dtype), returns


def _next_valid_values(v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`[B, T]`: v at the first valid position after t (0 if there is none)."""
    B, T = v.shape
    one_based = torch.arange(1, T + 1, device=v.device)
    # On reversed rows: 1 + index of the last valid position at or before k (0 if none).
    last = torch.where(valid.flip(-1), one_based, 0).cummax(dim=-1).values
    before = torch.zeros_like(last)
    before[:, 1:] = last[:, :-1]  # strictly before k in reversed time = strictly after t
    padded = torch.cat([v.new_zeros(B, 1), v.flip(-1)], dim=1)
    return padded.gather(1, before).flip(-1)
