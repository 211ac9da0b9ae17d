"""The step's batch as tensors, and how it is cut into mini-batches, DP shards and micro-batches.

Every rank holds the whole (global) rollout batch: responses are ordered prompt-major by global
prompt id, so every tensor here is identical on every rank and whatever is computed from it
(advantages, group statistics, batch whitening, mini-batch membership) does not depend on the
parallel layout. Each forward or backward pass then takes this rank's data-parallel share of a
set of global response indices (:func:`dp_share`).

Units follow verl (``megarl.config`` batch arithmetic): mini-batches count prompts × n
responses; micro-batches count responses per DP rank, or are packed to a token budget
(``use_dynamic_bsz``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megarl.models.runner import SequenceBatch


@dataclass
class RolloutTensors:
    """The global batch of one step: B responses, S = longest prompt+response, R = longest response.

    Filled in stages by the step (old/ref log-probs, rewards, advantages); every tensor is on
    the CPU and identical on every rank.
    """

    input_ids: torch.Tensor
    """``[B, S]`` prompt + response tokens, right-padded."""
    prompt_lengths: torch.Tensor
    """``[B]``."""
    lengths: torch.Tensor
    """``[B]`` prompt + response lengths."""
    response_mask: torch.Tensor
    """``[B, R]`` float 1/0: real response tokens (EOS included; a truncated response has none)."""
    prompt_ids: torch.Tensor
    """``[B]`` global prompt id of each response (the group of GRPO and its family)."""
    rollout_log_probs: torch.Tensor
    """``[B, R]`` the rollout engine's (temperature-processed) log-probs of the sampled tokens."""
    truncated: torch.Tensor
    """``[B]`` bool: the response hit max_tokens (no EOS)."""
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-step tensors added by the stages (``old_log_probs``, ``advantages``, ...)."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.lengths - self.prompt_lengths

    def sequences(self, rows: torch.Tensor, names: Sequence[str] = ()) -> SequenceBatch:
        """The rows ``rows`` as a runner batch, with ``names`` (and the mask) as extras."""
        lengths = self.lengths[rows]
        width = int(lengths.max().item()) if len(rows) else 1
        extra = {"response_mask": self.response_mask[rows]}
        extra.update({name: self.fields[name][rows] for name in names})
        return SequenceBatch(
            self.input_ids[rows, :width], self.prompt_lengths[rows], lengths, extra=extra
        )


def rollout_tensors(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    prompt_ids: Sequence[int],
    truncated: Sequence[bool],
    *,
    pad_token_id: int,
) -> RolloutTensors:
    """Right-padded tensors of B (prompt, response) pairs (an empty response gets mask 0)."""
    b = len(prompts)
    seq = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    width = max([len(r) for r in responses] + [1])
    input_ids = torch.full((b, seq), pad_token_id, dtype=torch.long)
    mask = torch.zeros(b, width)
    logp = torch.zeros(b, width)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, log_probs, strict=True)):
        input_ids[i, : len(p) + len(r)] = torch.tensor([*p, *r], dtype=torch.long)
        mask[i, : len(r)] = 1.0
        logp[i, : len(r)] = torch.tensor(lp, dtype=torch.float32)
    plen = torch.tensor([len(p) for p in prompts])
    return RolloutTensors(
        input_ids=input_ids,
        prompt_lengths=plen,
        lengths=plen + torch.tensor([len(r) for r in responses]),
        response_mask=mask,
        prompt_ids=torch.tensor(list(prompt_ids), dtype=torch.long),
        rollout_log_probs=logp,
        truncated=torch.tensor(list(truncated), dtype=torch.bool),
    )


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


def pad_token_id(tokenizer) -> int:
    """The id that right-pads token rows: the tokenizer's pad token, else its EOS, else 0 (padded
    positions are never attended to nor scored)."""
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id or 0)
