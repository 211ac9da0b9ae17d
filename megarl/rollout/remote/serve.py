"""The rollout ranks' side of a split launch: :func:`serve` runs the commands of
:class:`~megarl.rollout.remote.engine.RemoteEngine` (the protocol is in its module docstring)
on this rank's share of the rollout ranks' vLLM replicas.

Threads, one per group of :class:`~megarl.rollout.remote.split_world.Channels`, so that none
waits behind another:

- commands: receives each command on ``control`` as soon as it is sent and queues it for the
  main thread (the trainer asking ahead never waits for a generation);
- weights (``stage``, beyond one step off): receives each announced weight version on
  ``weights`` into the staging slot (:class:`_Staging`) while the main thread generates;
- replies (first rollout rank): sends each reply on ``replies``, in order.

The main thread runs the commands in order (the engine, the replicas' collectives and the
reward manager stay on it) and loads a request's weight version before generating it. Without
staging it loads each update straight into the engine when it reaches the command: no copy of
the weights, and one step off loses nothing by it, as the trainer waits for that batch next.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any

from megarl.rollout.remote.split_world import Channels, broadcast_object

__all__ = ["serve"]


class _Staging:
    """The staging slot between the weights thread and the main thread.

    It holds one version: the weights thread receives the next once the main thread has loaded
    or dropped the last (a version no request asks for is dropped when the next is announced).
    So the rollout side holds at most one copy of the weights besides its engine's (each rank
    only what its vLLM TP rank loads), and a trainer more than a version ahead waits in its
    weight sync.
    """

    def __init__(self) -> None:
        self.todo: queue.Queue = queue.Queue()
        """(version, plan) announced, for the weights thread (None: stop)."""
        self._cond = threading.Condition()
        self._slot: tuple[int, Any, list] | None = None
        self.error: BaseException | None = None

    def receive_all(self, group: Any, part: Any) -> None:
        """The weights thread: each announced version into the slot once it is free (this
        rank's pieces, ``part``)."""
        from megarl.rollout.remote.weights import receive_buckets

        while (item := self.todo.get()) is not None:
            version, plan = item
            with self._cond:
                self._cond.wait_for(lambda: self._slot is None)
            flats = list(receive_buckets(plan, group, part=part))
            with self._cond:
                self._slot = (version, plan, flats)
                self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self.error = exc
            self._cond.notify_all()

    def take(self, version: int) -> tuple[Any, list]:
        """The main thread: wait for ``version`` in the slot and empty it; its plan and
        buckets."""
        with self._cond:
            self._cond.wait_for(lambda: self._slot is not None or self.error is not None)
            if self._slot is None:
                raise RuntimeError(f"weight version {version} never came in") from self.error
            got, plan, flats = self._slot
            if got != version:  # the protocol's order broken: never expected
                raise RuntimeError(f"weight version {got} came in where {version} was expected")
            self._slot = None
            self._cond.notify_all()
        return plan, flats


def serve(
    engine: Any,
    channels: Channels,
    score: Any = None,
    *,
    stage: bool = True,
    part: tuple[int, int] = (1, 0),
    multi_turn: Any = None,
    partial: bool = False,
) -> None:
    """Run the training ranks' commands on ``engine`` until ``stop`` (see the module docstring);
    a thread's error (the trainer gone, a timeout) ends it with that error.

    ``score(batch, reward)``: scores a generated batch when its request asks for it (every
    rollout rank calls it, as the reward manager is collective); its error goes back as text.
    ``stage``: receive weight updates while generating, into the staging slot; False: each
    update goes straight into the engine, bucket by bucket, when the main thread reaches its
    command (no copy of the weights; the trainer's sync waits for the requests before it).
    ``part``: ``(rollout TP, this rank's vLLM TP rank)``: staging, what this rank receives of
    each update (its pieces only, :func:`~megarl.rollout.remote.weights.pack_part`).
    ``multi_turn``: the run's :class:`~megarl.rollout.multi_turn_rollout.MultiTurnRollout`, which
    answers the requests marked ``multi_turn`` (the whole loop, tools included, on these ranks).
    ``partial``: partial rollouts with continuous batching (:mod:`megarl.rollout.remote.stream`):
    every request joins the running batch as it arrives; an update stops the running responses,
    is loaded as soon as it is announced and they go on with the newest weights (needs
    ``stage`` off).
    """
    from megarl.rollout.remote.weights import load_buckets, receive_buckets

    inbox: queue.Queue = queue.Queue()
    """(arrival time, command) in the trainer's order, or (None, error) from a thread."""
    outbox: queue.Queue | None = queue.Queue() if channels.replies is not None else None
    staging = _Staging()

    def run(target, *args) -> threading.Thread:
        def body() -> None:
            try:
                target(*args)
            except BaseException as exc:  # noqa: BLE001 -- the main thread raises it
                staging.fail(exc)
                inbox.put((None, exc))

        thread = threading.Thread(target=body, name=f"megarl-{target.__name__}", daemon=True)
        thread.start()
        return thread

    def read_commands() -> None:
        while True:
            command = broadcast_object(channels.control, None, 0)
            if command[0] == "weights" and stage:
                staging.todo.put(command[1:])
            inbox.put((time.perf_counter(), command))
            if command[0] == "stop":
                return

    def send_replies() -> None:
        while (reply := outbox.get()) is not None:
            broadcast_object(channels.replies, reply, 1)

    threads = [run(read_commands)]
    if stage:
        threads.append(run(staging.receive_all, channels.weights, part))
    if outbox is not None:
        threads.append(run(send_replies))
    held, announced = -1, None  # the version the engine holds; the last one announced

    def load_now(command: tuple) -> None:
        buckets = receive_buckets(command[2], channels.weights, channels.weights_device)
        load_buckets(engine, command[2], buckets)

    def stop() -> None:
        if outbox is not None:
            outbox.put(None)
            threads[-1].join()  # the replies were all taken before the stop came

    try:
        if partial:
            if stage:
                raise ValueError("partial rollouts load each update as it comes: no staging")
            from megarl.rollout.distribute import object_group
            from megarl.rollout.remote.interrupts import ServeInterrupts
            from megarl.rollout.remote.stream import serve_stream

            pending: deque = deque()  # commands taken in and not yet run
            interrupts = ServeInterrupts(inbox, pending, load_now, held, object_group(None))
            serve_stream(engine, interrupts, inbox, lambda r: _reply(outbox, r), score)
            stop()
            return
        while True:
            waiting = time.perf_counter()
            arrived, command = inbox.get()
            if arrived is None:
                raise command
            idle = max(0.0, arrived - waiting)
            if command[0] == "stop":
                stop()
                return
            if command[0] == "eos":
                _reply(outbox, list(engine.eos_token_ids))
            elif command[0] == "weights" and not stage:
                load_now(command)
                held = command[1]
            elif command[0] == "adapter":  # lora.merge=false: staging refused it (engine.py)
                engine.load_adapter(command[2], command[3])
                held = command[1]
            elif command[0] == "weights":
                if announced is not None and announced != held:
                    staging.take(announced)  # no request asked for it: dropped
                announced = command[1]
            elif command[0] == "generate":
                version, requests = command[1], command[2]
                loading = time.perf_counter()
                if version != held:
                    load_buckets(engine, *staging.take(version), part=part)
                    held = version
                loaded = time.perf_counter() - loading
                for prompts, kwargs, reward in requests:  # one reply each, in order
                    reply = _generate(engine, prompts, kwargs, reward, score, multi_turn)
                    reply["timing"].update(idle=idle, update_weights=loaded)
                    _reply(outbox, reply)
                    idle = loaded = 0.0
            else:
                raise ValueError(f"unknown rollout command {command[0]!r}")
    finally:
        staging.todo.put(None)  # the threads still waiting are daemons: they end with the rank


def _reply(outbox: queue.Queue | None, reply: Any) -> None:
    """Queue ``reply`` for the replies thread (the first rollout rank; the others send none)."""
    if outbox is not None:
        outbox.put(reply)


def _generate(
    engine: Any, prompts: list, kwargs: dict, reward: dict | None, score: Any, multi_turn: Any
) -> dict:
    """One request of a ``generate`` command: the batch, its scores when asked (a result, or
    an error's one line: the scorer's own, or this one) and the seconds spent. A multi-turn
    request (``multi_turn`` in ``kwargs``) gets its trajectories back as the ``batch``, scored as
    the trainer's rollout batch of them."""
    from megarl.rollout.distribute import generate_on_replicas
    from megarl.rollout.multi_turn import rollout_samples

    start = time.perf_counter()
    if kwargs.get("multi_turn"):
        if multi_turn is None:
            raise RuntimeError("a multi-turn request reached rollout ranks without multi_turn")
        reply_batch = multi_turn.serve(engine, prompts, kwargs)
        batch = rollout_samples(reply_batch, kwargs["n"])
    else:
        reply_batch = batch = generate_on_replicas(engine, prompts, **kwargs)
    generated = time.perf_counter()
    scored = None
    if reward is not None and score is not None:
        try:
            scored = score(batch, reward)
        except Exception as exc:  # noqa: BLE001 -- the trainer raises it, in one line
            scored = f"{type(exc).__name__}: {exc}"
    timing = {"generate": generated - start, "score": time.perf_counter() - generated}
    return {"batch": reply_batch, "scored": scored, "timing": timing}
