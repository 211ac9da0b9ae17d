"""The weight sync of a vision-language actor (:mod:`megarl.models.vision_language`): the language
model through the text plan, and transformers' vision tower under its HF names, in one
weight-update session.

The language model's HF names (``model.layers.*``, ``model.embed_tokens.weight``,
``lm_head.weight``) are the hub layout of a Qwen2(.5)-VL checkpoint, which vLLM's VL model maps
onto its language model itself. The vision tower (patch embedding, blocks, merger) goes as
``visual.<name>``: whole tensors, since the actor replicates the tower on every TP rank and vLLM
narrows each to its own TP rank's part. With PP > 1 only the first stage holds the tower; the
other stages receive it from their first stage over the pipeline group, in buckets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.rollout.base import WeightSink
from megarl.rollout.reshard.executor import SyncStats
from megarl.rollout.reshard.megatron_sync import plan_for_chunks, sync_weights
from megarl.rollout.reshard.plan import DEFAULT_BUCKET_BYTES, ReshardPlan

if TYPE_CHECKING:
    from megarl.models.vision_language import VisionLanguageModel

__all__ = ["VISION_PREFIX", "plan_for_vision_language", "sync_vision_language_weights"]

VISION_PREFIX = "visual."
"""The vision tower's prefix in a Qwen2(.5)-VL hub checkpoint (what vLLM loads)."""


def plan_for_vision_language(
    model: VisionLanguageModel, rollout_tp: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> ReshardPlan:
    """The language model's plan (:func:`~megarl.rollout.reshard.plan_for_chunks`); the vision
    tower needs none (whole tensors, from the first stage)."""
    language = model.language
    return plan_for_chunks(language.chunks, language.dims, rollout_tp, bucket_bytes=bucket_bytes)


def sync_vision_language_weights(
    model: VisionLanguageModel, plan: ReshardPlan, sink: WeightSink
) -> SyncStats:
    """Push the VL actor's weights into the rollout engine (collective: every rank calls it):
    the vision tower first, then the language model's buckets, in one session. ``bytes`` of the
    result counts both (the tower's full tensors on every rank)."""
    from megatron.core import parallel_state

    if getattr(sink, "lora_adapter_sync", False):
        raise NotImplementedError("LoRA weight syncs of a vision-language actor are not built")
    pp_group = None
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
    tensors = vision_tensors(model.vision, pp_group, plan.bucket_bytes)
    first = _VisionTowerFirst(sink, tensors)
    stats = sync_weights(model.language.chunks, plan, first)
    return dataclasses.replace(stats, bytes=stats.bytes + first.sent)


def vision_tensors(
    vision: torch.nn.Module | None, pp_group: dist.ProcessGroup | None, bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """The vision tower's tensors as HF-named chunks of about ``bucket_bytes``: this rank's own
    tower's (``vision`` not None), or received from the pipeline group's first stage
    (``pp_group``, collective over it; every stage calls). Lazy, one chunk at a time; a received
    chunk has a buffer of its own (the engine may hold it until the session ends)."""
    if pp_group is None:
        if vision is None:
            raise ValueError("no vision tower on this rank and no pipeline group to receive it")
        state = vision.state_dict()
        for names in _chunks([(n, t.numel() * t.element_size()) for n, t in state.items()],
                             bucket_bytes):  # fmt: skip
            yield [(VISION_PREFIX + n, state[n].detach()) for n in names]
        return
    yield from _vision_tensors_over_pipeline(vision, pp_group, bucket_bytes)


def _vision_tensors_over_pipeline(
    vision: torch.nn.Module | None, group: dist.ProcessGroup, bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """:func:`vision_tensors` with PP > 1: the first stage broadcasts the names, shapes and
    dtype, then one flat buffer a chunk."""
    src = dist.get_global_rank(group, 0)
    owner = vision is not None
    state = vision.state_dict() if owner else {}
    layout: list[Any] = [[(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in
                          state.items()] if owner else None]  # fmt: skip
    dist.broadcast_object_list(layout, src=src, group=group)
    (entries,) = layout
    dtypes = {d for _, _, d in entries}
    if len(dtypes) != 1:
        raise TypeError(f"the vision tower's tensors have several dtypes {sorted(dtypes)}")
    dtype = getattr(torch, dtypes.pop())
    device = next(iter(state.values())).device if owner else _device()
    shapes = {n: s for n, s, _ in entries}
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [(n, math.prod(s) * itemsize) for n, s, _ in entries]
    for names in _chunks(sizes, bucket_bytes):
        flat = torch.empty(sum(math.prod(shapes[n]) for n in names), dtype=dtype, device=device)
        views, at = [], 0
        for n in names:
            view = flat[at : at + math.prod(shapes[n])].view(shapes[n])
            if owner:
                view.copy_(state[n])
            views.append((VISION_PREFIX + n, view))
            at += math.prod(shapes[n])
        dist.broadcast(flat, src=src, group=group)
        yield views


def _chunks(sizes: list[tuple[str, int]], bucket_bytes: int) -> Iterator[list[str]]:
    """Names in order, cut into runs of at most ``bucket_bytes`` (a larger tensor alone)."""
    names: list[str] = []
    total = 0
    for name, size in sizes:
        if names and total + size > bucket_bytes:
            yield names
            names, total = [], 0
        names.append(name)
        total += size
    if names:
        yield names


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _VisionTowerFirst:
    """The engine's weight-update session with the vision tower's chunks loaded as soon as it
    opens; everything else (the language model's buckets, the engine's attributes the executor
    checks) passes through."""

    def __init__(self, sink: WeightSink, chunks: Iterable[list[tuple[str, Tensor]]]) -> None:
        self._sink = sink
        self._chunks = chunks
        self.sent = 0
        """Bytes of vision tensors handed to the engine."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)

    def begin_weight_update(self) -> None:
        self._sink.begin_weight_update()
        for chunk in self._chunks:
            self._sink.load_weight_chunk(chunk)
            self.sent += sum(t.numel() * t.element_size() for _, t in chunk)

    def load_weight_chunk(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self._sink.load_weight_chunk(named_tensors)

    def finish_weight_update(self) -> None:
        self._sink.finish_weight_update()
