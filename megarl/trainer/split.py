"""How the step's batch is cut: mini-batches, data-parallel shares and micro-batches.

Units follow verl (:class:`megarl.config.BatchPlan`): mini-batches count prompts × n responses;
micro-batches count responses per DP rank, or are packed to a token budget (``use_dynamic_bsz``).
Every cut is computed from global response indices and seeded draws, so it is the same on every
rank, at every layout and after a resume.
"""

from __future__ import annotations

import hashlib

import torch


def seeded_generator(seed: int, *purpose: object) -> torch.Generator:
    """A CPU generator seeded by (run seed, purpose...), e.g. ``(seed, "minibatch", step, epoch)``:
    the same draws on every rank and at every layout, and after a resume."""
    digest = hashlib.blake2b(":".join(map(str, (seed, *purpose))).encode(), digest_size=8)
    return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)


def mini_batches(
    num_responses: int, responses_per_mini_batch: int, *, shuffle: bool, generator=None
) -> list[torch.Tensor]:
    """Global response indices of each mini-batch (a permutation when ``shuffle``)."""
    if num_responses % responses_per_mini_batch:
        raise ValueError(
            f"{num_responses} responses do not split into mini-batches of "
            f"{responses_per_mini_batch}"
        )
    order = (
        torch.randperm(num_responses, generator=generator)
        if shuffle
        else torch.arange(num_responses)
    )
    return list(order.split(responses_per_mini_batch))


def dp_share(
    indices: torch.Tensor, dp_rank: int, dp_size: int, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """This DP rank's share of a set of global indices (equal counts on every rank).

    Without ``lengths``: a contiguous slice. With ``lengths`` (``trainer.balance_batch``): the
    indices are dealt so that token counts are balanced — longest first, each to the rank with
    the fewest tokens that still has room — deterministically, so every rank computes the same
    partition. The set being partitioned (a mini-batch) is the same either way; only which rank
    computes which response changes, and the reduced gradient does not depend on that.
    """
    if len(indices) % dp_size:
        raise ValueError(f"{len(indices)} responses do not split over {dp_size} DP ranks")
    per = len(indices) // dp_size
    if lengths is None or dp_size == 1:
        return indices[dp_rank * per : (dp_rank + 1) * per]
    sizes = lengths[indices]
    order = torch.argsort(sizes, descending=True, stable=True).tolist()
    load = [0] * dp_size
    members: list[list[int]] = [[] for _ in range(dp_size)]
    for k in order:
        target = min(
            (r for r in range(dp_size) if len(members[r]) < per), key=lambda r: (load[r], r)
        )
        members[target].append(k)
        load[target] += int(sizes[k])
    return indices[torch.tensor(sorted(members[dp_rank]), dtype=torch.long)]


def token_budget_micro_batches(
    lengths: torch.Tensor, max_tokens: int, *, num_micro_batches: int | None = None
) -> list[torch.Tensor]:
    """Row indices of micro-batches of at most ``max_tokens`` tokens (``use_dynamic_bsz``).

    Greedy first-fit over rows sorted by length (longest first); a row longer than the budget
    gets a micro-batch of its own. ``num_micro_batches`` asks for at least that many (DP ranks
    use the largest count among them, so their schedules agree): the fullest ones are split.
    """
    order = torch.argsort(lengths, descending=True, stable=True)
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in order.tolist():
        size = int(lengths[row])
        for k, load in enumerate(loads):
            if load + size <= max_tokens:
                bins[k].append(row)
                loads[k] += size
                break
        else:
            bins.append([row])
            loads.append(size)
    while num_micro_batches is not None and len(bins) < num_micro_batches:
        k = max(range(len(bins)), key=lambda i: (len(bins[i]) > 1, loads[i]))
        if len(bins[k]) < 2:
            raise ValueError(
                f"cannot form {num_micro_batches} micro-batches from {len(lengths)} sequences"
            )
        half = len(bins[k]) // 2
        moved = bins[k][half:]
        bins[k] = bins[k][:half]
        loads[k] -= sum(int(lengths[r]) for r in moved)
        bins.append(moved)
        loads.append(sum(int(lengths[r]) for r in moved))
    return [torch.tensor(sorted(b), dtype=torch.long) for b in bins]


def micro_batches(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    dp_rank: int,
    dp_size: int,
    *,
    micro_batch_size: int | None,
    max_token_len: int | None,
    balance: bool = False,
    cp: int = 1,
) -> int | list[torch.Tensor]:
    """This DP rank's micro-batches of its share of ``indices``: the micro-batch size, or with a
    token budget ``max_token_len`` explicit rows of its share, as many on every DP rank (the
    most any share needs). ``balance``: shares balanced by ``lengths`` (:func:`dp_share`).

    ``max_token_len`` is per GPU, verl's ``*_max_token_len_per_gpu``: a micro-batch holds up to
    ``max_token_len × cp`` tokens, ``cp`` the context-parallel size whose ranks split each
    sequence (as verl's Megatron workers scale it)."""
    if max_token_len is None:
        return micro_batch_size  # type: ignore[return-value]
    max_token_len *= cp
    by = lengths if balance else None
    most = max(
        len(token_budget_micro_batches(lengths[dp_share(indices, r, dp_size, by)], max_token_len))
        for r in range(dp_size)
    )
    mine = dp_share(indices, dp_rank, dp_size, by)
    return token_budget_micro_batches(lengths[mine], max_token_len, num_micro_batches=most)


def fitting_micro_batch(rows: int, size: int) -> int:
    """The configured micro-batch size, lowered to a divisor of the rows (forward-only passes
    accept any split)."""
    size = max(1, min(size, rows))
    while rows % size:
        size -= 1
    return size
