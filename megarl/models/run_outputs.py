"""What the last pipeline stage returns per micro-batch, from its output tensor: an actor's
log-probs and entropy of the response tokens (and, when asked, sum_v pi^2 and a teacher's top-k),
a critic's values or a reward model's scores, response-aligned ``[b, R, ...]``
(:mod:`megarl.models.runner` calls it inside Megatron's schedule)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megarl.models.logprobs import (
    vocab_parallel_log_probs_and_entropy,
    vocab_parallel_sum_pi_squared,
)
from megarl.models.packing import TokenOrder, gather_over_cp
from megarl.models.topk_logprobs import vocab_parallel_topk_log_probs

Outputs = dict[str, torch.Tensor]


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
        return out

    return outputs_of
