"""A teacher's scores of the student's samples from vLLM's prompt log-probs (issue 57's vLLM
teacher, verl 0.9's way): each student sequence (prompt + response) goes to the teacher's engine
as a prompt with ``prompt_logprobs=k`` and one token to generate, and vLLM returns, at every
position, the teacher's log-probs of its top-k tokens and of the token actually there.

vLLM computes prompt log-probs from the raw logits (``log_softmax``, no temperature, no sampling
processors, whatever ``logprobs_mode`` says: ``gpu_model_runner._get_prompt_logprobs_dict``), so
these are the teacher's distribution at temperature 1, as verl's vLLM teacher scores them.
Position ``p + j`` (response token ``j`` of a prompt of ``p`` tokens) is scored by the logits at
``p + j - 1``: vLLM's entry ``p + j`` of ``prompt_logprobs``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["TeacherScores", "prompt_topk_log_probs"]

_REQUEST_IDS = itertools.count()


@dataclass
class TeacherScores:
    """The teacher's scores of ``N`` responses, right-padded to the longest ``R`` (0 past each
    response's end)."""

    topk_ids: torch.Tensor
    """``[N, R, k]`` int64: the teacher's top-k token ids at each response position, by rank."""
    topk_log_probs: torch.Tensor
    """``[N, R, k]`` float32: their log-probs."""
    log_probs: torch.Tensor
    """``[N, R]`` float32: the teacher's log-prob of the response token actually there."""


def prompt_topk_log_probs(
    engine, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], k: int
) -> TeacherScores:
    """Score each of ``sequences`` (prompt + response token ids; the first ``prompt_lengths[i]``
    of sequence ``i`` are its prompt, at least one) on ``engine`` (a
    :class:`~megarl.rollout.vllm_engine.VLLMEngine` of the teacher, whose ``max_logprobs`` is at
    least ``k``). Every TP rank of the engine calls it with the same arguments."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from megarl.parallel.emulation import device_routing_suspended

    if k < 1:
        raise ValueError(f"top-k must be >= 1, got {k}")
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        if not 1 <= p <= len(seq):
            raise ValueError(f"sequence {i}: prompt length {p} outside 1..{len(seq)}")
    llm = engine.llm_engine
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
    ids = {}
    for i, seq in enumerate(sequences):
        request_id = f"teacher-{next(_REQUEST_IDS)}"
        llm.add_request(request_id, TokensPrompt(prompt_token_ids=list(seq)), params)
        ids[request_id] = i
    scored: dict[int, list] = {}
    with device_routing_suspended():  # vLLM's CPU engine names no CUDA device
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    scored[ids[out.request_id]] = out.prompt_logprobs
    width = max((len(s) - p for s, p in zip(sequences, prompt_lengths, strict=True)), default=0)
    n = len(sequences)
    topk_ids = torch.zeros(n, width, k, dtype=torch.int64)
    topk_lp = torch.zeros(n, width, k, dtype=torch.float32)
    sampled = torch.zeros(n, width, dtype=torch.float32)
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        positions = scored[i]
        for j in range(len(seq) - p):
            entry = positions[p + j]  # {token id: Logprob(logprob, rank, ...)}
            by_rank = sorted((lp.rank, tok, lp.logprob) for tok, lp in entry.items())
            top = [(tok, value) for rank, tok, value in by_rank if rank <= k][:k]
            if len(top) < k:
                raise RuntimeError(
                    f"vLLM returned {len(top)} of the top-{k} log-probs at position {p + j} of "
                    f"sequence {i} (its max_logprobs must be >= {k})"
                )
            topk_ids[i, j] = torch.tensor([tok for tok, _ in top])
            topk_lp[i, j] = torch.tensor([value for _, value in top])
            sampled[i, j] = entry[seq[p + j]].logprob
    return TeacherScores(topk_ids, topk_lp, sampled)
