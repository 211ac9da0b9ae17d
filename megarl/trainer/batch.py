"""The step's batch: one typed record of every tensor a training step produces.

Every rank holds the whole (global) batch, responses ordered prompt-major by global prompt id,
so every tensor is identical on every rank and anything computed from it (advantages, group
statistics, mini-batch membership) does not depend on the parallel layout. :func:`rollout_batch`
fills the rollout's fields; the phases of :func:`megarl.trainer.step.train_step` return their
tensors and only ``train_step`` assigns them, in the order the fields are listed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megarl.models.routing import ROUTING
from megarl.models.runner import SequenceBatch
from megarl.models.vl_inputs import IMAGES, ImageRows

BATCH = "batch"
"""The runner extra under which a loss function finds its micro-batch's :class:`StepBatch` rows."""


@dataclass
class StepBatch:
    """The global batch of one step: B responses, S = longest prompt + response, R = longest
    response. Every tensor is on the CPU, ``[B, ...]``, identical on every rank; a field is
    None until the phase that produces it has run (or when the run has no such phase)."""

    # -- from the rollout ---------------------------------------------------------------------
    input_ids: torch.Tensor
    """``[B, S]`` prompt + response tokens, right-padded."""
    prompt_lengths: torch.Tensor
    """``[B]`` prompt lengths."""
    lengths: torch.Tensor
    """``[B]`` prompt + response lengths."""
    response_mask: torch.Tensor
    """``[B, R]`` float 1/0: the model's response tokens (EOS included; a truncated response has
    none; 0 on a multi-turn response's tool and user tokens)."""
    prompt_ids: torch.Tensor
    """``[B]`` global prompt id of each response (the group of GRPO and its family)."""
    rollout_log_probs: torch.Tensor
    """``[B, R]`` the rollout engine's (temperature-processed) log-probs of the sampled tokens."""
    truncated: torch.Tensor
    """``[B]`` bool: the response hit max_tokens (no EOS)."""
    rollout_routing: torch.Tensor | None = None
    """``[B, S, model layers, k]`` int16: the experts the rollout routed each token to (R3)."""
    images: ImageRows | None = None
    """Each response's prompt images (a vision-language actor's; the processor's pixels and
    grids, repeated for each response of a prompt); every pass gets its rows' images."""

    # -- added by the step's phases, in this order ---------------------------------------------
    token_level_scores: torch.Tensor | None = None
    """``[B, R]`` the scores on each response's last token (before any KL penalty)."""
    token_level_rewards: torch.Tensor | None = None
    """``[B, R]`` the rewards the advantages use (the scores, less β·KL with KL in the reward)."""
    recomputed_log_probs: torch.Tensor | None = None
    """``[B, R]`` the actor's log-probs of the rollout before the update (none in bypass mode)."""
    sum_pi_squared: torch.Tensor | None = None
    """``[B, R]`` sum_v π_old(v)² at each response position (``calculate_sum_pi_squared``)."""
    routing: torch.Tensor | None = None
    """``[B, actor MoE layers here, S, k]``: the routing the actor's forwards replay (R2: recorded
    by the old-log-prob pass; R3: the rollout's, for this pipeline rank's layers)."""
    ref_log_probs: torch.Tensor | None = None
    """``[B, R]`` the reference policy's log-probs (KL loss or KL in the reward)."""
    teacher_log_probs: torch.Tensor | None = None
    """``[B, R]`` the distillation teacher's log-probs of the sampled tokens."""
    teacher_topk_log_probs: torch.Tensor | None = None
    """``[B, R, k]`` the teacher's k largest log-probs at each response position, by rank (a
    top-k loss mode: ``forward_kl_topk``)."""
    teacher_topk_ids: torch.Tensor | None = None
    """``[B, R, k]`` int64: their token ids (where the update scores the student)."""
    old_log_probs: torch.Tensor | None = None
    """``[B, R]`` π_old of the policy loss: recomputed, or the rollout's in bypass mode."""
    rollout_is_weights: torch.Tensor | None = None
    """``[B, R]`` truncated importance weights π_old / π_rollout (``rollout_is``)."""
    values: torch.Tensor | None = None
    """``[B, R]`` the critic's values before the update."""
    reward_baselines: torch.Tensor | None = None
    """``[B]`` ReMax: the score of each prompt's greedy response."""
    advantages: torch.Tensor | None = None
    """``[B, R]``."""
    returns: torch.Tensor | None = None
    """``[B, R]`` the critic's targets."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.lengths - self.prompt_lengths

    def select(self, rows: torch.Tensor) -> StepBatch:
        """The rows ``rows`` of every field that is set."""
        return self._map(lambda t: t[rows])

    __getitem__ = select  # the runner slices its extras per micro-batch with ``[rows]``

    def to(self, device: torch.device | str) -> StepBatch:
        return self._map(lambda t: t.to(device))

    def _map(self, fn) -> StepBatch:
        return StepBatch(
            **{
                f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                for f in dataclasses.fields(self)
            }
        )

    def sequences(
        self, rows: torch.Tensor, *, loss_inputs: bool = False, replay: torch.Tensor | None = None
    ) -> SequenceBatch:
        """The rows ``rows`` as a runner batch, cut to their longest sequence. ``loss_inputs``:
        the rows' :class:`StepBatch` goes along for the loss function (extra ``BATCH``, without
        the routing fields and the images); ``replay`` (``[B, layers, S, k]``): the routing the
        routers replay. The rows' images, if any, go along (extra ``IMAGES``)."""
        lengths = self.lengths[rows]
        width = int(lengths.max().item()) if len(rows) else 1
        extra = {}
        if loss_inputs:
            rows_only = dataclasses.replace(self, rollout_routing=None, routing=None, images=None)
            extra[BATCH] = rows_only.select(rows)
        if self.images is not None:
            extra[IMAGES] = self.images[rows]
        if replay is not None:
            extra[ROUTING] = replay[rows]
        return SequenceBatch(
            self.input_ids[rows, :width], self.prompt_lengths[rows], lengths, extra=extra
        )


def rollout_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    prompt_ids: Sequence[int],
    truncated: Sequence[bool],
    *,
    pad_token_id: int,
    token_masks: Sequence[Sequence[int] | None] | None = None,
) -> StepBatch:
    """Right-padded tensors of B (prompt, response) pairs (an empty response gets mask 0).

    ``token_masks``: per response, None (every token is the model's) or 1/0 per token, 0 on the
    tool and user turns of a multi-turn response: ``response_mask`` is 0 there, so every loss,
    KL, entropy and aggregation leaves those tokens out."""
    b = len(prompts)
    seq = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    width = max([len(r) for r in responses] + [1])
    input_ids = torch.full((b, seq), pad_token_id, dtype=torch.long)
    mask = torch.zeros(b, width)
    logp = torch.zeros(b, width)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, log_probs, strict=True)):
        input_ids[i, : len(p) + len(r)] = torch.tensor([*p, *r], dtype=torch.long)
        own = None if token_masks is None else token_masks[i]
        mask[i, : len(r)] = 1.0 if own is None else torch.tensor(own, dtype=torch.float32)
        logp[i, : len(r)] = torch.tensor(lp, dtype=torch.float32)
    plen = torch.tensor([len(p) for p in prompts])
    return StepBatch(
        input_ids=input_ids,
        prompt_lengths=plen,
        lengths=plen + torch.tensor([len(r) for r in responses]),
        response_mask=mask,
        prompt_ids=torch.tensor(list(prompt_ids), dtype=torch.long),
        rollout_log_probs=logp,
        truncated=torch.tensor(list(truncated), dtype=torch.bool),
    )


def batch_from_samples(samples: Sequence, *, pad_token_id: int) -> StepBatch:
    """:func:`rollout_batch` of an engine's ``RolloutSample``s, in their order: truncated where
    the engine stopped at the length limit, each sample's ``response_mask`` (multi-turn: 1 on the
    model's tokens only) as its token mask."""
    return rollout_batch(
        [s.prompt_token_ids for s in samples],
        [s.response_token_ids for s in samples],
        [s.response_logprobs for s in samples],
        [s.prompt_id for s in samples],
        [s.finish_reason == "length" for s in samples],
        pad_token_id=pad_token_id,
        token_masks=[s.response_mask for s in samples],
    )


def pad_token_id(tokenizer) -> int:
    """The id that right-pads token rows: the tokenizer's pad token, else its EOS, else 0 (padded
    positions are never attended to nor scored)."""
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id or 0)
