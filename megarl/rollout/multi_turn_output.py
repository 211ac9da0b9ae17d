"""The multi-turn loop's trajectories into the trainer (:mod:`megarl.rollout.multi_turn`):
the rollout batch (:func:`rollout_samples`) and the step's ``multi_turn/*`` metrics
(:func:`multi_turn_metrics`; :func:`merge_multi_turn_metrics` joins several generation
batches' as dynamic sampling draws them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from megarl.rollout.base import RolloutBatch, RolloutSample
from megarl.tools.runner import ToolCallError

if TYPE_CHECKING:
    from megarl.rollout.multi_turn_types import Trajectory

__all__ = ["merge_multi_turn_metrics", "multi_turn_metrics", "rollout_samples"]


def rollout_samples(trajs: Sequence[Trajectory], n: int) -> RolloutBatch:
    """The trajectories as the trainer's rollout batch, with each sample's per-token mask and
    its multi-turn record (``extra``: turns, tool rewards, interaction scores)."""
    samples = [
        RolloutSample(
            t.prompt_index,
            t.sample_index,
            t.prompt_ids,
            t.response_ids,
            t.response_logprobs,
            "length" if t.finish_reason == "length" else "stop",
            prompt_id=t.prompt_id,
            routing=t.routing,
            response_mask=list(t.response_mask),
            extra={
                "num_turns": t.num_turns,
                "tool_rewards": list(t.tool_rewards),
                "turn_scores": list(t.turn_scores),
            },
        )
        for t in trajs
    ]
    return RolloutBatch(samples, n)


def multi_turn_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """The step's multi-turn metrics: turns and calls per trajectory, errors by kind, tool
    seconds, tokenisation mismatches."""
    if not trajs:
        return {}
    b = len(trajs)
    results = [r for t in trajs for r in t.tool_results]
    out = {
        "multi_turn/num_turns/mean": sum(t.num_turns for t in trajs) / b,
        "multi_turn/num_turns/max": float(max(t.num_turns for t in trajs)),
        "multi_turn/assistant_turns/mean": sum(t.assistant_turns for t in trajs) / b,
        "multi_turn/tool_calls/mean": len(results) / b,
        "multi_turn/tool_calls/total": float(len(results)),
        "multi_turn/tool_errors/total": float(
            sum(r.error is not ToolCallError.NONE for r in results)
        ),
        "multi_turn/tool_seconds/total": float(sum(r.seconds for r in results)),
        "multi_turn/tool_success_rate": (
            sum(r.error is ToolCallError.NONE for r in results) / len(results) if results else 0.0
        ),
        "multi_turn/tokenization_mismatches": float(sum(t.tokenization_ok is False for t in trajs)),
    }
    for kind in ToolCallError:
        if kind is not ToolCallError.NONE:
            out[f"multi_turn/tool_errors/{kind.value}"] = float(
                sum(r.error is kind for r in results)
            )
    return out


def merge_multi_turn_metrics(parts: Sequence[tuple[Mapping[str, float], int]]) -> dict[str, float]:
    """:func:`multi_turn_metrics` of several batches of trajectories together, from each
    batch's ``(metrics, number of trajectories)``: means weighted by trajectories, maxima of
    maxima, totals and counts summed, the success rate over all calls; {} when no part has
    multi-turn metrics (single-turn rollouts)."""
    parts = [(m, b) for m, b in parts if m]
    if not parts:
        return {}
    b = sum(n for _, n in parts)
    out: dict[str, float] = {}
    for key in parts[0][0]:
        values = [m[key] for m, _ in parts]
        if key.endswith("/mean"):
            out[key] = sum(m[key] * n for m, n in parts) / b
        elif key.endswith("/max"):
            out[key] = max(values)
        else:
            out[key] = float(sum(values))
    calls = out["multi_turn/tool_calls/total"]
    ok = calls - out["multi_turn/tool_errors/total"]
    out["multi_turn/tool_success_rate"] = ok / calls if calls else 0.0
    return out
