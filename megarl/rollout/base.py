"""The narrow interface between the trainer and a rollout engine, and what a rollout returns.

The trainer only ever talks to rollout through :class:`RolloutEngine` (``generate``,
``update_weights``, ``sleep``, ``wake_up``); vLLM stays inside :mod:`megarl.rollout.vllm_engine`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "FinishReason",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutSample",
    "request_seed",
]

FinishReason = Literal["stop", "length"]


@dataclass
class RolloutSample:
    """One response to one prompt."""

    prompt_index: int
    """Position of the prompt in the prompt list the caller passed."""
    sample_index: int
    """Which of the ``n`` responses to that prompt (0..n-1)."""
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    """Generated tokens; ends with the stop/EOS token when ``finish_reason == "stop"``."""
    response_logprobs: list[float]
    """Log-prob of each generated token under the sampling distribution, i.e.
    ``log_softmax(logits / temperature)`` (after top-k/top-p masking when those are on)."""
    finish_reason: FinishReason
    """``"stop"``: ended on an EOS/stop token (included in the response); ``"length"``: hit
    ``max_tokens`` (no EOS)."""

    def __post_init__(self) -> None:
        if len(self.response_logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"{len(self.response_logprobs)} log-probs for "
                f"{len(self.response_token_ids)} response tokens"
            )


@dataclass
class RolloutBatch:
    """Responses ordered prompt-major: prompt 0 samples 0..n-1, prompt 1 samples 0..n-1, ..."""

    samples: list[RolloutSample] = field(default_factory=list)
    n: int = 1
    """Responses per prompt."""

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[RolloutSample]:
        return iter(self.samples)

    def __getitem__(self, i: int) -> RolloutSample:
        return self.samples[i]

    @property
    def num_prompts(self) -> int:
        return len(self.samples) // self.n if self.n else 0

    def check_order(self) -> None:
        """Raise unless samples are prompt-major with prompt indices 0..num_prompts-1."""
        for i, s in enumerate(self.samples):
            want = (i // self.n, i % self.n)
            if (s.prompt_index, s.sample_index) != want:
                raise ValueError(
                    f"sample {i} is (prompt {s.prompt_index}, sample {s.sample_index}), "
                    f"expected {want}"
                )

    def padded_responses(self, pad_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
        """Right-padded responses: ``token_ids [B, T]`` (long), ``logprobs [B, T]`` (float32),
        ``mask [B, T]`` (bool, True on real tokens); ``T`` = longest response (at least 1)."""
        b = len(self.samples)
        t = max([len(s.response_token_ids) for s in self.samples] + [1])
        ids = torch.full((b, t), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((b, t), dtype=torch.float32)
        mask = torch.zeros((b, t), dtype=torch.bool)
        for i, s in enumerate(self.samples):
            k = len(s.response_token_ids)
            ids[i, :k] = torch.tensor(s.response_token_ids, dtype=torch.long)
            logprobs[i, :k] = torch.tensor(s.response_logprobs, dtype=torch.float32)
            mask[i, :k] = True
        return ids, logprobs, mask


def request_seed(seed: int, step: int, prompt_id: int, sample_index: int) -> int:
    """Sampling seed of one response: a hash of (run seed, step, global prompt id, sample index).

    Deterministic across processes (not Python's salted ``hash``), so every rank of a rollout TP
    group draws the same tokens, and independent of how prompts are spread over rollout DP ranks.
    """
    digest = hashlib.blake2b(
        f"{seed}:{step}:{prompt_id}:{sample_index}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine. Every rank calls every method (SPMD)."""

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int,
        stop_token_ids: list[int] | None = None,
        seed: int,
        step: int = 0,
        prompt_ids: Sequence[int] | None = None,
    ) -> RolloutBatch:
        """``n`` responses per prompt, prompt-major. Response ``(p, s)`` is sampled with
        ``request_seed(seed, step, prompt_ids[p], s)`` (``prompt_ids`` defaults to
        ``range(len(prompts))``; pass global prompt ids when ``prompts`` is a shard). The model's
        EOS ids always stop generation; ``stop_token_ids`` adds more."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Replace the weights with Hugging Face-named full (unsharded) tensors; the engine slices
        them for its own TP layout. The iterable may be a lazy generator (streamed buckets); a
        partial set updates only the named tensors. Cached prefixes are dropped afterwards."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory (weights offloaded, KV cache dropped); no-op on CPU."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what :meth:`sleep` freed (``tags``: ``"weights"``, ``"kv_cache"``; None:
        all); no-op on CPU."""
        ...
