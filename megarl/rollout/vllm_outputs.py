"""vLLM's request outputs read as megarl's rollout samples: the sampled tokens' log-probs and one
``RequestOutput`` as a :class:`~megarl.rollout.base.RolloutSample` (for
:class:`~megarl.rollout.vllm_engine.VLLMEngine`, the partial rollouts' streamer and the rollout
ranks' stream)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megarl.rollout.base import RolloutSample

__all__ = ["sample_from_output", "sampled_logprobs"]


def sampled_logprobs(tokens: Sequence[int], logprobs: Any) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-response log-probs (``logprobs=0``).

    ``logprobs`` is a ``FlatLogprobs`` (``flat_logprobs=True``: vLLM's sampler puts the sampled
    token first in each position's range) or the legacy list of ``{token_id: Logprob}``.
    """
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"{len(logprobs)} log-prob positions for {len(tokens)} tokens")
    if not hasattr(logprobs, "start_indices"):  # list[dict[int, Logprob]]
        return [step[t].logprob for t, step in zip(tokens, logprobs, strict=True)]
    starts = logprobs.start_indices
    if [logprobs.token_ids[i] for i in starts] != list(tokens):
        raise RuntimeError("vLLM's flat log-probs do not start with the sampled tokens")
    return [logprobs.logprobs[i] for i in starts]


def sample_from_output(
    out: Any, prompt: list[int], prompt_index: int, sample_index: int, prompt_id: int
) -> RolloutSample:
    """One vLLM ``RequestOutput`` (``n=1``, ``logprobs=0``) as a :class:`RolloutSample`."""
    (completion,) = out.outputs
    tokens = list(completion.token_ids)
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(
            f"prompt {prompt_index} sample {sample_index}: finish_reason {completion.finish_reason}"
        )
    logprobs = sampled_logprobs(tokens, completion.logprobs)
    return RolloutSample(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_token_ids=list(prompt),
        response_token_ids=tokens,
        response_logprobs=logprobs,
        finish_reason=completion.finish_reason,
        prompt_id=prompt_id,
    )
