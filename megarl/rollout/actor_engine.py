"""A rollout engine that samples from the Megatron actor itself (no vLLM).

For trainer tests and debugging: it needs no engine start-up, no weight sync (it *is* the
trained model) and is exactly reproducible. It re-runs the full prefix every decoding step (no
KV cache), so it is only meant for tiny models and short responses.

Every rank of the actor's model-parallel group calls :meth:`ActorEngine.generate` with the same
prompts (its data-parallel shard). Logits of the last position are gathered over TP and
broadcast from the last pipeline stage, and tokens are drawn with a per-request
``torch.Generator`` seeded by :func:`megarl.rollout.base.request_seed`, so every rank draws the
same tokens without any further communication.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.models.runner import forward_logits, gather_vocab
from megarl.rollout.base import RolloutBatch, RolloutSample, request_seed


def last_position_logits(
    chunks: Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Full-vocabulary logits ``[N, vocab_size]`` at position ``lengths - 1``, on every rank."""
    n = input_ids.shape[0]
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    # The interleaved (VPP) schedule needs at least PP micro-batches: pad rows and split.
    num_mb = pp if len(chunks) > 1 else 1
    rows = -(-n // num_mb) * num_mb
    if rows != n:
        input_ids = torch.cat([input_ids, input_ids[:1].expand(rows - n, -1)])
        lengths = torch.cat([lengths, lengths[:1].expand(rows - n)])
    mb_size = rows // num_mb
    seq = int(lengths.max())
    last = lengths.split(mb_size)

    def keep(index: int, logits: torch.Tensor) -> torch.Tensor:
        idx = (last[index].to(logits.device) - 1)[:, None, None].expand(-1, 1, logits.shape[-1])
        return logits.gather(1, idx).squeeze(1)

    kept = forward_logits(chunks, input_ids[:, :seq].split(mb_size), keep)
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
    """:class:`megarl.rollout.base.RolloutEngine` backed by the actor's own Megatron chunks."""

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
        prompt_ids: list[int] | None = None,
    ) -> RolloutBatch:
        """Sample ``n`` responses per prompt; log-probs are of ``softmax(logits / temperature)``."""
        if top_p != 1.0 or top_k not in (-1, 0):
            raise ValueError("ActorEngine samples from the full distribution: top_p=1, top_k=-1")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        stops = set(self.eos_token_ids) | set(stop_token_ids or [])
        ids_of = prompt_ids if prompt_ids is not None else list(range(len(prompts)))
        requests = [(p, s) for p in range(len(prompts)) for s in range(n)]
        gens = [
            torch.Generator().manual_seed(request_seed(seed, step, ids_of[p], s))
            for p, s in requests
        ]
        seqs = [list(prompts[p]) for p, _ in requests]
        responses: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        done = [False] * len(requests)
        device = next(self.chunks[0].parameters()).device
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
            log_p = torch.log_softmax(logits.cpu().double() / temperature, dim=-1)
            for row, i in enumerate(active):
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
            )
            for i, (p, s) in enumerate(requests)
        ]
        return RolloutBatch(samples=samples, n=n)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to do: the engine samples from the live actor weights."""
        for _ in named_tensors:
            pass

    def sleep(self) -> None:
        """No separate state to offload."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """No separate state to reload."""
