"""``rollout_trace_op``: verl's tracing decorator, here a pass-through.

verl's own tools decorate ``execute`` with ``verl.utils.rollout_trace.rollout_trace_op``; a tool
copied from verl keeps the decorator after its import changes to this module. megarl has no
rollout tracing (``actor_rollout_ref.rollout.trace`` is refused), so the function is returned
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["rollout_trace_op"]

F = TypeVar("F", bound=Callable)


def rollout_trace_op(func: F) -> F:
    """``func`` itself."""
    return func
