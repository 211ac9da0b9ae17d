"""Megatron → vLLM weight resharding: a pure plan and an executor that streams buckets.

    plan = plan_for_chunks(chunks, dims, rollout_tp=2)      # or make_reshard_plan(...)
    stats = sync_weights(chunks, plan, engine)              # collective, every rank
    plan.received(pp_rank, rollout_rank)                    # bytes a rank receives per sync

:mod:`~megarl.rollout.reshard.plan` knows nothing of processes; it is what ``megarl plan``
prints. :mod:`~megarl.rollout.reshard.executor` moves the bytes;
:mod:`~megarl.rollout.reshard.megatron_sync` feeds it an actor's chunks (Megatron is imported
only when :func:`sync_weights` runs).
"""

from megarl.rollout.reshard.executor import (
    SyncStats,
    WeightSink,
    stream_buckets,
    write_hf_from_shards,
)
from megarl.rollout.reshard.make_plan import make_reshard_plan
from megarl.rollout.reshard.megatron_sync import plan_for_chunks, sync_weights
from megarl.rollout.reshard.plan import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    HFSlot,
    ParamTransfer,
    RankTraffic,
    ReshardPlan,
    SlicePiece,
    owner_of,
    rollout_slice,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "HFSlot",
    "ParamTransfer",
    "RankTraffic",
    "ReshardPlan",
    "SlicePiece",
    "SyncStats",
    "WeightSink",
    "make_reshard_plan",
    "owner_of",
    "plan_for_chunks",
    "rollout_slice",
    "stream_buckets",
    "sync_weights",
    "write_hf_from_shards",
]
