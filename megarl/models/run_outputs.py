"""What the last pipeline stage returns per micro-batch, from its output tensor: an actor's
log-probs and entropy of the response tokens (and, when asked, sum_v pi^2, a teacher's top-k, or
the log-probs at given ids: a distillation student's at its teacher's top-k), a critic's values
or a reward model's scores, response-aligned ``[b, R, ...]`` (:mod:`megarl.models.runner` calls
it inside Megatron's schedule)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megarl.models.logprobs import (
    vocab_parallel_log_probs_and_entropy,
    vocab_parallel_sum_pi_squared,
)
from megarl.models.packing import TokenOrder, gather_over_cp
from megarl.models.topk_logprobs import vocab_parallel_log_probs_at, vocab_parallel_topk_log_probs

Outputs = dict[str, torch.Tensor]

SCORE_IDS = "score_ids"
"""The batch extra ``[N, R, k]`` of token ids per response position (a distillation teacher's
top-k) at which an actor also returns its log-probs, as ``LOG_PROBS_AT_IDS``."""
LOG_PROBS_AT_IDS = "log_probs_at_ids"
"""``[b, R, k]`` log softmax(logits / temperature) at the ``SCORE_IDS``, differentiable."""
IDS_IN_TOPK = "ids_in_topk"
"""``[b, R, k]`` 1/0: whether each of the ``SCORE_IDS`` is among the actor's own k most likely
tokens there (vocab-parallel top-k; verl's teacher/student top-k overlap)."""


def gather_response(
    per_pos: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor, r: int
) -> torch.Tensor:
    """``out[i, k] = per_pos[i, p_i - 1 + k]`` for real response tokens, 0 past the response
    (``per_pos`` ``[b, s, ...]``: trailing dimensions follow)."""
    k = torch.arange(r, device=per_pos.device)[None, :]
    idx = (prompt_lengths[:, None] - 1 + k).clamp(0, per_pos.shape[1] - 1)
    valid = k < (lengths - prompt_lengths)[:, None]
    extra = per_pos.shape[2:]
    idx = idx.view(*idx.shape, *([1] * len(extra))).expand(*idx.shape, *extra)
    valid = valid.view(*valid.shape, *([1] * len(extra)))
    return torch.where(valid, per_pos.gather(1, idx), 0.0)


def place_response(
    per_token: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor, width: int
) -> torch.Tensor:
    """The inverse of :func:`gather_response`: ``out[i, p_i - 1 + k] = per_token[i, k]`` for
    real response tokens, 0 elsewhere; ``per_token`` ``[b, R, ...]``, ``out`` ``[b, width, ...]``."""
    b, r = per_token.shape[:2]
    k = torch.arange(r, device=per_token.device)[None, :]
    valid = k < (lengths - prompt_lengths)[:, None]
    pos = (prompt_lengths[:, None] - 1 + k).expand(b, r)
    rows = torch.arange(b, device=per_token.device)[:, None].expand(b, r)
    out = per_token.new_zeros((b, width, *per_token.shape[2:]))
    out[rows[valid], pos[valid]] = per_token[valid]
    return out


def output_fn(
    role: str,
    r: int,
    vocab_size: int | None,
    temperature: float,
    sum_pi_squared: bool = False,
    topk: int | None = None,
):
    """Per-micro-batch outputs of the last stage from its output tensor."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()

    def outputs_of(output_tensor: torch.Tensor, mb: dict, order: TokenOrder | None) -> Outputs:
        """``order``: the packed row's tokens (None: right-padded ``[b, s]`` rows)."""

        def per_position(values: torch.Tensor) -> torch.Tensor:  # -> [b, s]
            return values if order is None else order.to_grid(gather_over_cp(values[0]))

        if role in ("critic", "reward"):
            values = output_tensor.squeeze(-1)
            values = per_position(values.to(torch.promote_types(values.dtype, torch.float32)))
            if role == "reward":
                return {"scores": values.gather(1, mb["lengths"][:, None] - 1)}
            return {"values": gather_response(values, mb["prompt_lengths"], mb["lengths"], r)}
        targets = torch.roll(mb["input_ids"], shifts=-1, dims=1)
        if order is not None:
            targets = order.from_grid(targets, 0)[None]
        logp, ent = vocab_parallel_log_probs_and_entropy(
            output_tensor,
            targets,
            vocab_size=vocab_size,  # type: ignore[arg-type]
            temperature=temperature,
            vocab_start=tp_rank * output_tensor.shape[-1],
            group=tp_group,
        )
        plen, lens = mb["prompt_lengths"], mb["lengths"]
        out = {
            "log_probs": gather_response(per_position(logp), plen, lens, r),
            "entropy": gather_response(per_position(ent), plen, lens, r),
        }
        if sum_pi_squared:
            sq = vocab_parallel_sum_pi_squared(
                output_tensor.detach(),
                vocab_size=vocab_size,  # type: ignore[arg-type]
                temperature=temperature,
                vocab_start=tp_rank * output_tensor.shape[-1],
                group=tp_group,
            )
            out["sum_pi_squared"] = gather_response(per_position(sq), plen, lens, r)
        if topk is not None:
            values, ids = vocab_parallel_topk_log_probs(
                output_tensor, topk, vocab_size=vocab_size,  # type: ignore[arg-type]
                temperature=temperature, vocab_start=tp_rank * output_tensor.shape[-1],
                group=tp_group,
            )  # fmt: skip
            out["topk_log_probs"] = gather_response(per_position(values), plen, lens, r)
            out["topk_ids"] = gather_response(per_position(ids.to(values.dtype)), plen, lens, r)
        if SCORE_IDS in mb:  # [b, R', k] response-aligned, placed at the positions predicting them
            ids = place_response(mb[SCORE_IDS][:, :r], plen, lens, mb["input_ids"].shape[1])
            ids = ids if order is None else order.from_grid(ids, 0)[None]
            at = vocab_parallel_log_probs_at(
                output_tensor, ids, vocab_size=vocab_size,  # type: ignore[arg-type]
                temperature=temperature, vocab_start=tp_rank * output_tensor.shape[-1],
                group=tp_group,
            )  # fmt: skip
            out[LOG_PROBS_AT_IDS] = gather_response(per_position(at), plen, lens, r)
            _, own = vocab_parallel_topk_log_probs(
                output_tensor.detach(), ids.shape[-1], vocab_size=vocab_size,  # type: ignore[arg-type]
                temperature=temperature, vocab_start=tp_rank * output_tensor.shape[-1],
                group=tp_group,
            )  # fmt: skip
            shared = (ids[..., :, None] == own[..., None, :]).any(-1).to(at.dtype)
            out[IDS_IN_TOPK] = gather_response(per_position(shared), plen, lens, r)
        return out

    return outputs_of
