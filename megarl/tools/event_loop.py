"""Where tool and interaction turns run: one event loop kept for a whole run
(:class:`ToolEventLoop`), and a process-wide pool of daemon threads for tools' blocking work
(:func:`tool_thread_pool`, :func:`to_tool_thread`).

Why not ``asyncio.run`` per turn: it closes its loop each time, so a tool holding an asyncio lock,
semaphore or client session (bound to the loop that first used it) fails from the second turn
("bound to a different event loop"); and on closing it joins the default thread pool without a
limit, so a synchronous tool that hangs past ``tool_call_timeout_s`` hangs the whole step. verl
keeps one loop per agent-loop worker likewise.

The pool's threads are daemons and never joined (neither per turn nor at interpreter exit): a
call that runs past its time limit is answered ``timed out`` and its thread finishes (or hangs)
in the background, holding one of the pool's workers meanwhile.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import queue
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["DaemonThreadPool", "ToolEventLoop", "TurnAborted", "to_tool_thread", "tool_thread_pool"]

T = TypeVar("T")


class DaemonThreadPool(ThreadPoolExecutor):
    """A thread pool whose threads are daemons and are never joined: ``shutdown`` does nothing
    (``ThreadPoolExecutor``'s threads are joined at interpreter exit, so one hung call would
    keep the process alive). A ``ThreadPoolExecutor`` only so that an event loop takes it as
    its default executor; none of its machinery is used."""

    def __init__(self, max_workers: int | None = None, thread_name_prefix: str = "megarl-tool"):
        # ThreadPoolExecutor.__init__ deliberately not called (see the class docstring).
        self._max = max_workers or min(32, (os.cpu_count() or 1) + 4)
        self._name = thread_name_prefix
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._started = 0

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._work.put((future, fn, args, kwargs))
        with self._lock:
            if not self._idle.acquire(blocking=False) and self._started < self._max:
                self._started += 1
                name = f"{self._name}_{self._started}"
                threading.Thread(target=self._serve, name=name, daemon=True).start()
        return future

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._work.get()
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing: the threads serve the whole process and die with it."""


_POOL: DaemonThreadPool | None = None
_POOL_LOCK = threading.Lock()


def tool_thread_pool() -> DaemonThreadPool:
    """The process-wide pool for tools' blocking work (``min(32, cpus + 4)`` threads, as
    ``ThreadPoolExecutor``'s default), made on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = DaemonThreadPool()
        return _POOL


async def to_tool_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``asyncio.to_thread`` on :func:`tool_thread_pool` (so under any event loop, even one of
    ``asyncio.run``, a time limit around it is not undone by a join at the loop's end)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(tool_thread_pool(), call)


class TurnAborted(RuntimeError):
    """A tool or interaction turn given up because the run cannot go on (:meth:`ToolEventLoop.run`'s
    ``abort``: e.g. another rank of the node has died)."""


async def _watched(
    coro: Coroutine[Any, Any, T], abort: Callable[[], str | None], poll_s: float
) -> T:
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if (reason := abort()) is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=poll_s)  # a tool that ignores it is left behind
            raise TurnAborted(reason)


class ToolEventLoop:
    """One event loop for every tool and interaction turn it runs (made on first use, its
    default executor :func:`tool_thread_pool`, so ``asyncio.to_thread`` in a tool is never
    joined either). Runs coroutines from synchronous code, one at a time; not picklable state
    (a copy starts without a loop)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        *,
        abort: Callable[[], str | None] | None = None,
        poll_s: float = 0.5,
    ) -> T:
        """Run ``coro`` to its end on the kept loop and return its result. ``abort``: asked every
        ``poll_s`` seconds while ``coro`` runs; a line from it cancels ``coro`` (a tool's
        thread runs on, unjoined) and raises :class:`TurnAborted` with it."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
            self._loop.set_default_executor(tool_thread_pool())
        if abort is None:
            return self._loop.run_until_complete(coro)
        return self._loop.run_until_complete(_watched(coro, abort, poll_s))

    def close(self) -> None:
        """Close the loop (a later :meth:`run` makes a new one); the pool's threads stay."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()
        self._loop = None

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._loop = None
