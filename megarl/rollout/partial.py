"""Partial rollouts: a generation that stops at a token boundary when new weights arrive, loads
them and continues every unfinished response on them (verl's fully-async
``async_training.partial_rollout``; slime's partial rollout, AReaL's interruptible generation).

:func:`generate_interruptible` drives vLLM's engine one step at a time instead of through
``LLM.generate``. Between two engine steps it asks its :class:`Interrupts` whether to stop; when
it does, every unfinished request is aborted, :meth:`Interrupts.swap` loads the new weights, and
each unfinished response goes on as a new request whose prompt is the old prompt plus the tokens
generated so far (token ids: nothing is re-tokenised), with the rest of the token budget. Every
token keeps the log-prob vLLM reported when it was sampled and the weight version that sampled
it (:attr:`RolloutSample.token_versions <megarl.rollout.base.RolloutSample.token_versions>`).

Each segment of a response is seeded on its own (``request_seed`` of the response's seed and the
segment number): uninterrupted, a response draws exactly what ``LLM.generate`` would draw.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Interrupts", "Segmented", "generate_interruptible", "segment_seed"]


class Interrupts(Protocol):
    """What an interruptible generation asks between two engine steps (on every rank of every
    rollout replica at once: the answers must agree, so implementations are collective)."""

    version: int
    """The weight version the engine holds now: the one that samples the next tokens."""

    def poll(self, busy: bool) -> tuple[bool, bool]:
        """``(stop now, any replica still generating)`` given whether this rank's engine has
        unfinished requests; collective over the rollout replicas."""
        ...

    def swap(self) -> None:
        """Load the weights that made :meth:`poll` say stop (and set :attr:`version`)."""
        ...


@dataclass
class Segmented:
    """One response generated in one or more segments."""

    prompt: list[int]
    seed: int
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    segments: int = 0
    """Requests this response has been sent to vLLM as (1 when never interrupted)."""


def segment_seed(seed: int, segment: int) -> int:
    """The seed of segment ``segment`` of a response seeded ``seed`` (segment 0: ``seed``)."""
    if segment == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:segment:{segment}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def generate_interruptible(
    llm_engine: Any,
    responses: Sequence[Segmented],
    make_params: Callable[[int, int], Any],
    interrupts: Interrupts,
    *,
    lora_request: Any = None,
    sampled_logprobs: Callable[[Sequence[int], Any], list[float]],
) -> int:
    """Generate every response in ``responses`` to its end on ``llm_engine`` (a vLLM
    ``LLMEngine``), interrupting at the token boundaries :meth:`Interrupts.poll` asks for
    (the module docstring); returns the number of interruptions.

    ``make_params(max_tokens, seed)``: the request's ``SamplingParams`` (vLLM's ``DELTA``
    output kind: each step reports the new tokens). Fills each response's tokens, log-probs,
    versions and finish reason in place.
    """
    from vllm.inputs import TokensPrompt

    interruptions = 0
    running: dict[str, Segmented] = {}

    def submit() -> None:
        for i, r in enumerate(responses):
            if r.finish_reason is not None:
                continue
            left = r.max_tokens - len(r.tokens)
            if left <= 0:  # interrupted right at its budget: nothing left to generate
                r.finish_reason = "length"
                continue
            request_id = f"partial-{i}-{r.segments}"
            params = make_params(left, segment_seed(r.seed, r.segments))
            r.segments += 1
            llm_engine.add_request(
                request_id, TokensPrompt(prompt_token_ids=r.prompt + r.tokens), params,
                lora_request=lora_request,
            )  # fmt: skip
            running[request_id] = r

    submit()
    while True:
        busy = bool(running)
        stop, anyone = interrupts.poll(busy)
        if stop:
            if running:
                llm_engine.abort_request(list(running))
                running.clear()
            interrupts.swap()
            interruptions += 1
            submit()
            continue
        if not anyone:
            return interruptions
        if not busy:  # another replica is still generating: poll again with it
            continue
        version = interrupts.version
        for out in llm_engine.step():
            r = running.get(out.request_id)
            if r is None:
                continue
            (completion,) = out.outputs
            new = list(completion.token_ids)
            if new:
                r.tokens += new
                r.logprobs += sampled_logprobs(new, completion.logprobs)
                r.versions += [version] * len(new)
            if out.finished:
                if completion.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"finish_reason {completion.finish_reason} in a rollout")
                r.finish_reason = completion.finish_reason
                del running[out.request_id]
