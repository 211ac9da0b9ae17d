"""A rollout engine that samples from the Megatron actor itself (no vLLM).

For trainer tests and debugging: no engine start-up, exactly reproducible. It re-runs the full
prefix every decoding step (no KV cache), so it suits only tiny models and short responses.

It samples from the actor's live parameters, so a weight update has nothing to load: it still
runs the session (same call-order errors as vLLM) and consumes every chunk, and after
``sync_weights(chunks, plan, engine)`` it samples from the actor's current weights by
construction. ``sleep``/``wake_up`` free nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.models.gpt import chunks_device
from megarl.models.runner import (
    forward_logits,
    gather_vocab,
    interleaved_multiple,
    micro_batching,
    pad_rows,
)
from megarl.rollout.base import CallOrder, RolloutBatch, RolloutSample, request_seed

__all__ = ["ActorEngine", "last_position_logits"]


def last_position_logits(
    chunks: Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Full-vocabulary logits ``[N, vocab_size]`` at position ``lengths - 1``, on every rank."""
    n = input_ids.shape[0]
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    # As few micro-batches as the schedule allows (PP of them under VPP), the rows padded.
    rows, mb_size = micro_batching(n, n, interleaved_multiple(chunks))
    input_ids, lengths = pad_rows(input_ids, rows), pad_rows(lengths, rows)
    seq = int(lengths.max())
    last = lengths.split(mb_size)

    def keep(index: int, logits: torch.Tensor) -> torch.Tensor:
        idx = (last[index].to(logits.device) - 1)[:, None, None].expand(-1, 1, logits.shape[-1])
        return logits.gather(1, idx).squeeze(1)

    kept = forward_logits(chunks, input_ids[:, :seq].split(mb_size), keep, lengths=last)
    device = input_ids.device
    if kept is not None:
        full = gather_vocab(torch.cat(kept)[:n], vocab_size).contiguous()
    else:
        full = torch.empty(n, vocab_size, dtype=torch.float32, device=device)
    if pp > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        dist.broadcast(full, src=dist.get_global_rank(group, pp - 1), group=group)
    return full


class ActorEngine:
    """:class:`megarl.rollout.base.RolloutEngine` backed by the actor's own Megatron chunks.

    Rollout replicas are Megatron's data-parallel replicas (``dp_rank`` = Megatron's DP rank):
    every rank of one model-parallel group (TP × PP, not contiguous in rank order when PP > 1)
    calls :meth:`generate` with the same prompts. The last position's logits are gathered over
    TP and broadcast from the last pipeline stage, and each request draws from a
    ``torch.Generator`` seeded by :func:`~megarl.rollout.base.request_seed`, so every rank draws
    the same tokens without further communication.

    Args:
        chunks: this rank's model chunks (Megatron parallel state initialised).
        vocab_size: real (unpadded) vocabulary size; padded logits are never sampled.
        eos_token_ids: ids that end a response.
        pad_token_id: filler of the right-padded decoding batch (never attended to).
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        pad_token_id: int = 0,
    ) -> None:
        self.chunks = list(chunks)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.tensor_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self._order = CallOrder()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int,
        stop_token_ids: list[int] | None = None,
        seed: int,
        step: int = 0,
        prompt_ids: Sequence[int] | None = None,
        interrupts: Any = None,
        images: Sequence[Sequence[Any] | None] | None = None,
    ) -> RolloutBatch:
        """Sample ``n`` responses per prompt (see ``RolloutEngine.generate``; no partial
        rollouts and no images: ``interrupts`` and ``images`` are refused); log-probs are of
        ``log_softmax(logits / temperature)``. Only full-distribution sampling (top_p 1, top_k
        off); temperature 0 is greedy decoding (log-probs of ``log_softmax(logits)``), as in
        vLLM."""
        self._order.check_can_generate()
        if interrupts is not None:
            raise ValueError("partial rollouts need vLLM (rollout.name=vllm on ranks of its own)")
        if images is not None:
            raise ValueError("image prompts need vLLM's engine (rollout.name=vllm)")
        if n < 1 or max_tokens < 1:
            raise ValueError(f"need n >= 1 and max_tokens >= 1, got n={n}, max_tokens={max_tokens}")
        if top_p != 1.0 or top_k not in (-1, 0):
            raise ValueError("ActorEngine samples from the full distribution: top_p=1, top_k=-1")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
        stops = set(self.eos_token_ids) | set(stop_token_ids or [])
        ids_of = list(prompt_ids) if prompt_ids is not None else list(range(len(prompts)))
        if len(ids_of) != len(prompts):
            raise ValueError(f"{len(ids_of)} prompt_ids for {len(prompts)} prompts")
        requests = [(p, s) for p in range(len(prompts)) for s in range(n)]
        gens = [
            torch.Generator().manual_seed(request_seed(seed, step, ids_of[p], s))
            for p, s in requests
        ]
        seqs = [list(prompts[p]) for p, _ in requests]
        responses: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        done = [False] * len(requests)
        device = chunks_device(self.chunks)
        for _ in range(max_tokens):
            active = [i for i, d in enumerate(done) if not d]
            if not active:
                break
            width = max(len(seqs[i]) for i in active)
            ids = torch.full((len(active), width), self.pad_token_id, dtype=torch.long)
            for row, i in enumerate(active):
                ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
            lengths = torch.tensor([len(seqs[i]) for i in active])
            logits = last_position_logits(self.chunks, ids.to(device), lengths, self.vocab_size)
            log_p = torch.log_softmax(logits.cpu().double() / (temperature or 1.0), dim=-1)
            for row, i in enumerate(active):
                if temperature == 0:
                    token = int(log_p[row].argmax().item())
                else:
                    token = int(torch.multinomial(log_p[row].exp(), 1, generator=gens[i]).item())
                seqs[i].append(token)
                responses[i].append(token)
                logprobs[i].append(float(log_p[row, token]))
                if token in stops:
                    done[i] = True
        samples = [
            RolloutSample(
                prompt_index=p,
                sample_index=s,
                prompt_token_ids=list(prompts[p]),
                response_token_ids=responses[i],
                response_logprobs=logprobs[i],
                finish_reason="stop" if responses[i] and responses[i][-1] in stops else "length",
                prompt_id=int(ids_of[p]),
            )
            for i, (p, s) in enumerate(requests)
        ]
        if device.type == "cuda":
            # Every step's logits had a new width: the allocator's cache holds blocks the next
            # phase cannot reuse (and NCCL, allocating outside it, would find the GPU full).
            torch.cuda.empty_cache()
        return RolloutBatch(samples=samples, n=n)

    def begin_weight_update(self) -> None:
        """Open an update (nothing to prepare: the engine samples from the live actor)."""
        self._order.begin_update()

    def load_weight_chunk(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume the chunk and drop it: the actor's parameters already hold these weights."""
        self._order.check_updating("load_weight_chunk")
        for _ in named_tensors:
            pass

    def finish_weight_update(self) -> None:
        """Close the update."""
        self._order.finish_update()

    def sleep(self, level: int = 1) -> None:
        """Nothing to free; ``level=2`` still requires a weight update before generating."""
        self._order.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Nothing to reload."""
