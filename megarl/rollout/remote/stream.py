"""Continuous batching for partial rollouts: the rollout ranks' serving loop when
``async_training.partial_rollout`` is on (:func:`~megarl.rollout.remote.serve.serve`).

One :class:`~megarl.rollout.partial.Streamer` holds every request asked so far: a request joins
the running vLLM batch as soon as it arrives, while the earlier ones are still in their long
tail (verl's fully-async rollouter streams samples the same way), and each request gets its
reply, in the order asked, once every replica has finished its share. A weight update the
trainer announces stops every running response at the same token boundary, is loaded, and the
responses go on (:mod:`megarl.rollout.partial`).

The replicas agree on everything with one all-reduce per engine step
(:meth:`~megarl.rollout.remote.interrupts.ServeInterrupts.poll_stream`): whether an update is
announced, whether any replica still generates, how many requests every rank has received (so
all admit the same ones) and how many of the oldest requests every replica has finished (so
all gather, score and reply to the same ones, in the same order). Commands that are not
requests (``eos``, ``stop``) wait until every request before them has been answered.

Each reply's ``timing``: ``generate`` from the request joining to its last token (requests
overlap, so these add up to more than the wall time), ``score``, ``idle`` (the rank's wait with
no request since the last reply), ``update_weights`` and ``interruptions`` since the last
reply.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megarl.rollout.distribute import gather_from_replicas, in_order, object_group, replica_share

__all__ = ["serve_stream"]


@dataclass
class _Admitted:
    """A request in the running batch: this replica's share of it, as a job."""

    ids: list[int]
    n: int
    reward: dict | None
    job: Any
    joined: float


def serve_stream(
    engine: Any, interrupts: Any, inbox: queue.Queue, reply: Callable[[Any], None], score: Any
) -> None:
    """Run the trainer's commands with continuous batching; returns at ``stop`` (the module
    docstring). ``interrupts``: the loop's
    :class:`~megarl.rollout.remote.interrupts.ServeInterrupts` (its ``pending`` holds the
    commands taken in); ``reply``: sends a reply (queues it on the first rollout rank, drops it
    on the others); ``score``: as :func:`~megarl.rollout.remote.serve.serve`'s."""
    from megarl.rollout.partial import Streamer
    from megarl.rollout.vllm_outputs import sampled_logprobs

    group = object_group(None)
    streamer = Streamer(engine.llm_engine, sampled_logprobs)
    queued: deque = deque()  # requests (prompts, kwargs, reward) and barriers ("eos"/"stop",)
    admitted: deque[_Admitted] = deque()
    idle, loaded, stops = 0.0, interrupts.loaded_s, interrupts.interruptions
    while True:
        _move_requests(interrupts.pending, queued)
        if not admitted and not queued and not interrupts.pending:
            waiting = time.perf_counter()
            arrived, command = inbox.get()
            if arrived is None:
                raise command
            idle += max(0.0, arrived - waiting)
            interrupts.pending.append((arrived, command))
            continue
        if (
            not admitted
            and queued
            and isinstance(queued[0], str)
            and not interrupts.update_pending()
        ):
            barrier = queued.popleft()
            if barrier == "stop":
                return
            reply(list(engine.eos_token_ids))
            continue
        available = next((i for i, q in enumerate(queued) if isinstance(q, str)), len(queued))
        finished = next((i for i, a in enumerate(admitted) if not a.job.done), len(admitted))
        stop, anyone, available, finished = interrupts.poll_stream(
            streamer.busy, available, finished
        )
        if stop:
            interrupts.interruptions += int(anyone)
            streamer.interrupt(interrupts.swap)
            continue
        for _ in range(finished):
            done = admitted.popleft()
            batch = in_order(gather_from_replicas(engine, done.job.finish(), group), done.ids,
                             done.n)  # fmt: skip
            generated = time.perf_counter()
            scored = None
            if done.reward is not None and score is not None:
                try:
                    scored = score(batch, done.reward)
                except Exception as exc:  # noqa: BLE001 -- the trainer raises it, in one line
                    scored = f"{type(exc).__name__}: {exc}"
            timing = {
                "generate": generated - done.joined,
                "score": time.perf_counter() - generated,
                "idle": idle,
                "update_weights": interrupts.loaded_s - loaded,
                "interruptions": interrupts.interruptions - stops,
            }
            reply({"batch": batch, "scored": scored, "timing": timing})
            idle, loaded, stops = 0.0, interrupts.loaded_s, interrupts.interruptions
        for _ in range(available):
            admitted.append(_admit(engine, streamer, *queued.popleft()))
        if streamer.busy:
            streamer.step(interrupts.version)


def _move_requests(pending: deque, queued: deque) -> None:
    """Every command taken in but ``weights`` (left in ``pending`` for the interrupts) onto
    ``queued``, in order: each request of a ``generate`` and each other command's name."""
    keep = deque()
    while pending:
        arrived, command = pending.popleft()
        if command[0] == "weights":
            keep.append((arrived, command))
        elif command[0] == "generate":
            queued.extend(command[2])
        elif command[0] in ("eos", "stop"):
            queued.append(command[0])
        else:
            raise ValueError(f"rollout command {command[0]!r} with partial rollouts")
    pending.extend(keep)


def _admit(engine: Any, streamer: Any, prompts: list, kwargs: dict, reward: dict | None):
    """Put this replica's share of a request into the running batch."""
    if kwargs.get("multi_turn"):
        raise ValueError("a multi-turn request with partial rollouts (refused at validation)")
    sampling = dict(kwargs)
    ids = list(sampling.pop("prompt_ids", None) or range(len(prompts)))
    mine, my_ids = replica_share(engine, prompts, ids)
    job = engine.partial_job(mine, prompt_ids=my_ids, **sampling)
    streamer.add(job)
    return _Admitted(ids, sampling["n"], reward, job, time.perf_counter())
