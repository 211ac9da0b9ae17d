"""Partial rollouts: a generation that stops at a token boundary when new weights arrive, loads
them and continues every unfinished response on them (verl's fully-async
``async_training.partial_rollout``; slime's partial rollout, AReaL's interruptible generation).

:class:`Streamer` drives vLLM's engine one step at a time instead of through ``LLM.generate``,
over the responses of any number of :class:`PartialJob` (a batch each): a job may join while
others run (continuous batching, :mod:`megarl.rollout.remote.stream`). When its caller stops it
for new weights, every unfinished request is aborted, the weights are loaded and each unfinished
response goes on as a new request whose prompt is the old prompt plus the tokens generated so
far (token ids: nothing is re-tokenised), with the rest of the token budget. Every token keeps
the log-prob vLLM reported when it was sampled and the weight version that sampled it
(:attr:`RolloutSample.token_versions <megarl.rollout.base.RolloutSample.token_versions>`).
:func:`generate_interruptible` is one job run to its end, asking an :class:`Interrupts` between
two engine steps whether to stop.

Each segment of a response is seeded on its own (``request_seed`` of the response's seed and the
segment number): uninterrupted, a response draws exactly what ``LLM.generate`` would draw.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "Interrupts", "PartialJob", "Segmented", "Streamer", "batch_job", "generate_interruptible",
    "segment_seed",
]  # fmt: skip


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


@dataclass
class PartialJob:
    """One batch of responses for a :class:`Streamer`: ``make_params(max_tokens, seed)`` gives a
    request's ``SamplingParams`` (vLLM's ``DELTA`` output kind: each step reports the new
    tokens); ``finish()`` turns the finished ``responses`` into the caller's result."""

    responses: list[Segmented]
    make_params: Callable[[int, int], Any]
    finish: Callable[[], Any]
    lora_request: Any = None

    @property
    def done(self) -> bool:
        return all(r.finish_reason is not None for r in self.responses)


def batch_job(
    prompts: list[list[int]],
    n: int,
    prompt_ids: Sequence[int],
    seeds: Sequence[Sequence[int]],
    max_tokens: int,
    make_params: Callable[[int, int], Any],
    lora_request: Any = None,
) -> PartialJob:
    """``n`` responses per prompt (prompt-major; ``seeds[p][s]`` the seed of response ``s`` of
    prompt ``p``) as one :class:`PartialJob` whose ``finish()`` is the
    :class:`~megarl.rollout.base.RolloutBatch`, each sample with the weight version of each
    token."""
    from megarl.rollout.base import RolloutBatch, RolloutSample

    keys = [(p, s) for p in range(len(prompts)) for s in range(n)]
    responses = [Segmented(list(prompts[p]), seeds[p][s], max_tokens) for p, s in keys]

    def finish() -> RolloutBatch:
        samples = [
            RolloutSample(
                p,
                s,
                list(prompts[p]),
                r.tokens,
                r.logprobs,
                r.finish_reason,
                prompt_id=prompt_ids[p],
                token_versions=r.versions,
            )
            for (p, s), r in zip(keys, responses, strict=True)
        ]
        return RolloutBatch(samples, n)

    return PartialJob(responses, make_params, finish, lora_request)


_REQUEST_IDS = itertools.count()
"""Request ids unique in the process (an engine outlives its streamers)."""


class Streamer:
    """vLLM's ``LLMEngine`` stepped over the responses of the jobs :meth:`add` gave it (the
    module docstring). ``sampled_logprobs(new tokens, completion.logprobs)``: the log-probs of
    the tokens a step reported."""

    def __init__(self, llm_engine: Any, sampled_logprobs: Callable[[Sequence[int], Any], list]):
        self.llm_engine, self._sampled_logprobs = llm_engine, sampled_logprobs
        self._running: dict[str, Segmented] = {}
        self._jobs: list[PartialJob] = []

    @property
    def busy(self) -> bool:
        """Whether a response is still generating here."""
        return bool(self._running)

    def add(self, job: PartialJob) -> None:
        """Send every unfinished response of ``job`` to the engine, as a request each."""
        self._jobs.append(job)
        self._submit(job)

    def _submit(self, job: PartialJob) -> None:
        from vllm.inputs import TokensPrompt

        for r in job.responses:
            if r.finish_reason is not None:
                continue
            left = r.max_tokens - len(r.tokens)
            if left <= 0:  # interrupted right at its budget: nothing left to generate
                r.finish_reason = "length"
                continue
            request_id = f"partial-{next(_REQUEST_IDS)}"
            params = job.make_params(left, segment_seed(r.seed, r.segments))
            r.segments += 1
            self.llm_engine.add_request(
                request_id, TokensPrompt(prompt_token_ids=r.prompt + r.tokens), params,
                lora_request=job.lora_request,
            )  # fmt: skip
            self._running[request_id] = r

    def interrupt(self, swap: Callable[[], None]) -> None:
        """Abort every running request, run ``swap`` (load the new weights) and send each
        unfinished response on as a new request."""
        if self._running:
            self.llm_engine.abort_request(list(self._running))
            self._running.clear()
        swap()
        self._jobs = [job for job in self._jobs if not job.done]
        for job in self._jobs:
            self._submit(job)

    def step(self, version: int) -> None:
        """One engine step; its tokens are recorded as sampled by weight ``version``."""
        from megarl.parallel.emulation import device_routing_suspended

        with device_routing_suspended():  # vLLM's CPU engine names no CUDA device
            outputs = self.llm_engine.step()
        for out in outputs:
            r = self._running.get(out.request_id)
            if r is None:
                continue
            (completion,) = out.outputs
            new = list(completion.token_ids)
            if new:
                r.tokens += new
                r.logprobs += self._sampled_logprobs(new, completion.logprobs)
                r.versions += [version] * len(new)
            if out.finished:
                if completion.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"finish_reason {completion.finish_reason} in a rollout")
                r.finish_reason = completion.finish_reason
                del self._running[out.request_id]


def segment_seed(seed: int, segment: int) -> int:
    """The seed of segment ``segment`` of a response seeded ``seed`` (segment 0: ``seed``)."""
    if segment == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:segment:{segment}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def generate_interruptible(
    llm_engine: Any,
    job: PartialJob,
    interrupts: Interrupts,
    *,
    sampled_logprobs: Callable[[Sequence[int], Any], list[float]],
) -> int:
    """Generate every response of ``job`` to its end on ``llm_engine`` (a vLLM ``LLMEngine``),
    interrupting at the token boundaries :meth:`Interrupts.poll` asks for (the module
    docstring); returns the number of interruptions. Fills each response's tokens, log-probs,
    versions and finish reason in place.
    """
    streamer = Streamer(llm_engine, sampled_logprobs)
    streamer.add(job)
    interruptions = 0
    while True:
        busy = streamer.busy
        stop, anyone = interrupts.poll(busy)
        if stop:
            streamer.interrupt(interrupts.swap)
            interruptions += 1
            continue
        if not anyone:
            return interruptions
        if busy:  # else another replica is still generating: poll again with it
            streamer.step(interrupts.version)
