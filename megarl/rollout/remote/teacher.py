"""On-policy distillation's vLLM teacher on ranks of its own (the last ranks of a split launch:
:mod:`.split_world`, role ``teacher``; verl 0.9's teacher pool).

The teacher ranks start the teacher's vLLM engine (``distillation.teacher_models.*.inference``:
``pool / TP`` replicas of its tensor-parallel size) and run :func:`serve_teacher`; the first
training rank drives them through :class:`TeacherClient`, over two groups of its own with them:

- ``teacher_control`` (the first training rank, then every teacher rank): commands, broadcast by
  the first training rank: ``("score", sequences, prompt_lengths, k)`` scores each sequence
  (prompt + response token ids) with vLLM's prompt log-probs, each replica a contiguous share
  (:func:`megarl.rollout.teacher_scores.prompt_topk_log_probs`); ``("stop",)`` ends the loop;
- ``teacher_replies`` (the first training rank and the first teacher rank): each command's reply,
  a :class:`~megarl.rollout.teacher_scores.TeacherScores` of every sequence in order, or the one
  line of the error that stopped the scoring (raised on the training ranks as
  :class:`TeacherError`).

The replicas' shares are gathered over the teacher side's own default group (gloo). Several
teachers (``teacher_key`` routing: :mod:`megarl.config.teachers`) each have a block of the
teacher ranks, a world and a pair of groups of their own (``teacher_control/<i>``,
``teacher_replies/<i>`` after the first's); each gets the sequences routed to it, all at once,
and the replies are put back in the sequences' order. Only the first training rank talks to
the teacher ranks; :meth:`TeacherClient.score` gives its result to
every training rank over the training world.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megarl.config.batch_plan import as_int
from megarl.config.teachers import TeacherSpec
from megarl.rollout.remote.split_world import SplitWorld, broadcast_object
from megarl.rollout.teacher_scores import TeacherScores

__all__ = ["TeacherClient", "TeacherError", "serve_teacher", "start_teacher_engine"]

DEFAULT_MAX_LOGPROBS = 20
"""vLLM's own ``max_logprobs`` default: the teacher's engine is started with at least the
top-k (``distillation_loss.topk``) when ``engine_kwargs.vllm.max_logprobs`` is not given."""


class TeacherError(RuntimeError):
    """The teacher ranks failed to score a batch, or stopped answering: one line."""


def teacher_topk(cfg) -> int:
    """How many of the teacher's log-probs per position the trainer asks for: the top-k of a
    top-k loss mode, else 1 (the estimators read only the sampled token's, which vLLM returns
    beside them)."""
    from megarl.config.schema_distill import TOPK_LOSS_MODES

    loss = cfg.distillation.distillation_loss
    return int(loss.topk) if loss.loss_mode in TOPK_LOSS_MODES else 1


def start_teacher_engine(cfg, spec: TeacherSpec):
    """The vLLM engine of teacher ``spec`` (one of :func:`megarl.config.teachers.teachers`) on
    this teacher rank (its teacher's block of ranks is its world), from its ``model_path`` and
    ``inference.*``: it reads the teacher's checkpoint itself and never sleeps (these devices
    do nothing else)."""
    from megarl.data.tokenizer import trusts_remote_code
    from megarl.rollout.vllm_engine import VLLMEngine

    inference = spec.inference
    roll = cfg.actor_rollout_ref.rollout
    prompt = as_int(inference.get("prompt_length"), roll.prompt_length)
    response = as_int(inference.get("response_length"), roll.response_length)
    kwargs = dict(inference.get("engine_kwargs") or {})
    nested = kwargs.pop("vllm", None) or {}  # verl's engine_kwargs.vllm.*; sglang's ignored
    kwargs.pop("sglang", None)
    kwargs.update(nested)
    kwargs["max_logprobs"] = max(as_int(kwargs.get("max_logprobs"), DEFAULT_MAX_LOGPROBS),
                                 teacher_topk(cfg))  # fmt: skip
    optional = {
        "max_num_batched_tokens": as_int(inference.get("max_num_batched_tokens")),
        "max_num_seqs": as_int(inference.get("max_num_seqs")),
    }
    return VLLMEngine(
        spec.model_path,
        tensor_parallel_size=spec.tp,
        seed=cfg.trainer.seed,
        dtype=cfg.trainer.dtype,
        max_model_len=as_int(inference.get("max_model_len"), prompt + response + 1),
        gpu_memory_utilization=float(inference.get("gpu_memory_utilization", 0.5)),
        free_cache_engine=False,
        enforce_eager=bool(inference.get("enforce_eager", True)),
        enable_prefix_caching=bool(inference.get("enable_prefix_caching", True)),
        enable_chunked_prefill=bool(inference.get("enable_chunked_prefill", True)),
        engine_kwargs=kwargs,
        tokenizer_path=spec.model_path,
        load_weights=True,
        trust_remote_code=trusts_remote_code(cfg),
        **{k: v for k, v in optional.items() if v is not None},
    )


def _channels(world: SplitWorld, index: int) -> tuple[Any, Any]:
    """Teacher ``index``'s ``(teacher_control, teacher_replies)``, each None where this process
    is not a member; created by every member in this order."""
    ranks = world.teacher_blocks()[index]
    suffix = f"/{index}" if index else ""
    control = world.group(f"teacher_control{suffix}", [0, *ranks])
    replies = world.group(f"teacher_replies{suffix}", [0, ranks[0]])
    return control, replies


class TeacherClient:
    """The training ranks' handle on the teacher ranks (every training rank builds one; only the
    first talks to them). ``names``: the teachers' names, in the order of the world's blocks."""

    def __init__(self, world: SplitWorld, names: Sequence[str] = ("teacher_model",)) -> None:
        self.ranks = world.teacher_ranks
        self.blocks = world.teacher_blocks()
        self.names = list(names)
        self.timeout = world.timeout
        self._channels = (
            [_channels(world, i) for i in range(len(self.blocks))] if world.rank == 0 else None
        )

    def score(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lengths: Sequence[int],
        k: int,
        routes: Sequence[int] | None = None,
    ) -> TeacherScores:
        """The teachers' scores of ``sequences`` (the same on every training rank; every
        training rank calls it) with their top ``k`` at each response position; ``routes``:
        the teacher (an index of :attr:`names`) scoring each sequence (None: the first)."""
        routes = [0] * len(sequences) if routes is None else list(routes)
        reply: Any = None
        if self._channels is not None:
            reply = self._ask(sequences, prompt_lengths, k, routes)
        if dist.is_initialized() and dist.get_world_size() > 1:
            from megarl.rollout.distribute import object_group

            box = [reply]
            dist.broadcast_object_list(box, src=0, group=object_group(None))
            reply = box[0]
        if isinstance(reply, str):
            raise TeacherError(reply)
        return reply

    def _ask(self, sequences, prompt_lengths, k: int, routes: list[int]) -> TeacherScores | str:
        """Every teacher with sequences routed to it gets its share at once (they score
        concurrently); the replies, put back in the sequences' order, or an error's line."""
        assert self._channels is not None
        rows = {i: [j for j, r in enumerate(routes) if r == i] for i in range(len(self.blocks))}
        asked = [i for i, mine in rows.items() if mine]
        replies: dict[int, Any] = {}
        for i in asked:
            with self._answering(i):
                command = ("score", [list(sequences[j]) for j in rows[i]],
                           [int(prompt_lengths[j]) for j in rows[i]], int(k))  # fmt: skip
                broadcast_object(self._channels[i][0], command, 0)
        for i in asked:
            with self._answering(i):
                replies[i] = broadcast_object(self._channels[i][1], None, 1)
            if isinstance(replies[i], str):
                return f"{self._who(i)} failed to score: {replies[i]}"
        return _reordered([(rows[i], replies[i]) for i in asked], len(sequences))

    def shutdown(self) -> None:
        """Stop the teacher ranks (the first training rank sends; the others do nothing)."""
        if self._channels is not None:
            for i, (control, _) in enumerate(self._channels):
                with self._answering(i):
                    broadcast_object(control, ("stop",), 0)
            self._channels = None

    def _who(self, index: int) -> str:
        name = self.names[index] if index < len(self.names) else str(index)
        return f"the teacher ranks {self.blocks[index]} ({name})"

    @contextlib.contextmanager
    def _answering(self, index: int):
        """A collective with teacher ``index``'s ranks that fails (they died, or hung past the
        timeout) becomes one line naming them."""
        try:
            yield
        except RuntimeError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TeacherError(
                f"{self._who(index)} did not answer within {self.timeout} (dead or hung): {first}"
            ) from exc


def _reordered(parts: list[tuple[list[int], TeacherScores]], count: int) -> TeacherScores:
    """Several teachers' scores, each of the rows it was given, as one :class:`TeacherScores`
    in row order (right-padded to the longest response)."""
    if len(parts) == 1 and parts[0][0] == list(range(count)):
        return parts[0][1]
    width = max(p.log_probs.shape[1] for _, p in parts)
    k = parts[0][1].topk_ids.shape[2]
    first = parts[0][1]
    ids = first.topk_ids.new_zeros(count, width, k)
    values = first.topk_log_probs.new_zeros(count, width, k)
    log_probs = first.log_probs.new_zeros(count, width)
    for rows, p in parts:
        index, w = torch.tensor(rows), p.log_probs.shape[1]
        ids[index, :w], values[index, :w], log_probs[index, :w] = (
            p.topk_ids,
            p.topk_log_probs,
            p.log_probs,
        )
    return TeacherScores(ids, values, log_probs)


def serve_teacher(world: SplitWorld, engine) -> None:
    """A teacher rank: run the first training rank's commands on ``engine`` (the teacher's
    :class:`~megarl.rollout.vllm_engine.VLLMEngine`, one replica per ``engine.tensor_parallel_size`` teacher
    ranks) until it sends ``stop``."""
    from megarl.rollout.distribute import even_split
    from megarl.rollout.teacher_scores import prompt_topk_log_probs

    control, replies = _channels(world, world.teacher_index or 0)
    replicas = engine.dp_size
    while True:
        command = broadcast_object(control, None, 0)
        if command[0] == "stop":
            return
        _, sequences, prompt_lengths, k = command
        share = even_split(len(sequences), replicas, engine.dp_rank)
        try:
            mine: Any = prompt_topk_log_probs(
                engine, sequences[share.start : share.stop],
                prompt_lengths[share.start : share.stop], k,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 -- the trainer raises it as one line
            mine = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        if replies is not None:  # the first teacher rank: one reply per command
            broadcast_object(replies, _joined(parts[:: engine.tensor_parallel_size]), 1)


def _joined(parts: list[Any]) -> TeacherScores | str:
    """Each replica's scores, in replica order, as one :class:`TeacherScores` (right-padded to
    the longest response); the first error instead, if any replica failed."""
    for part in parts:
        if isinstance(part, str):
            return part
    width = max(p.log_probs.shape[1] for p in parts)
    k = parts[0].topk_ids.shape[2]

    def pad(t: torch.Tensor) -> torch.Tensor:
        widths = (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])
        return torch.nn.functional.pad(t, widths)

    return TeacherScores(
        torch.cat([pad(p.topk_ids) for p in parts]).view(-1, width, k),
        torch.cat([pad(p.topk_log_probs) for p in parts]).view(-1, width, k),
        torch.cat([pad(p.log_probs) for p in parts]),
    )
