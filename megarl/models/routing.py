"""Routing replay for Mixture-of-Experts models (verl's ``router_replay.mode=R2`` and ``R3``).

The update moves the routers, so without replay a token can reach other experts than in the
old-log-prob pass, and pi_new / pi_old then compares two different networks. R2: the old-log-prob
forward records each token's experts in every MoE layer and the update's forwards replay them.
R3: the rollout engine's choices (:mod:`megarl.rollout.routing_capture`) are replayed in the
old-log-prob, reference and update forwards. Megatron-Core's ``RouterReplay`` does the routing;
this module says when, and moves the choices between passes whose micro-batches differ.
Validation refuses activation recompute of the routers with routing replay.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.models.packing import TokenOrder

ROUTING = "routing"
"""The batch field holding the recorded choices (and the micro-batch extra replaying them)."""
ROLLOUT_ROUTING = "rollout_routing"
"""The batch field holding the rollout's choices (R3): ``[rows, positions, model layers, k]``."""


def rollout_routing(captured: Sequence, width: int) -> torch.Tensor:
    """The samples' captured routing (``RolloutSample.routing``, ``[positions, layers, k]``
    each) as one ``[rows, width, layers, k]`` int16 tensor, -1 past each sample's end."""
    layers, k = captured[0].shape[1:]
    out = torch.full((len(captured), width, layers, k), -1, dtype=torch.int16)
    for row, routing in enumerate(captured):
        out[row, : len(routing)] = torch.as_tensor(routing)
    return out


def agreement_over_world(counts: torch.Tensor) -> float:
    """``[agreeing tokens, tokens]`` summed over every rank (each pipeline stage's layers, each
    data-parallel share) as a share."""
    from megarl.parallel.init import device

    counts = counts.to(device())
    torch.distributed.all_reduce(counts)
    return float(counts[0] / counts[1].clamp(min=1.0))


def routers(chunk: torch.nn.Module) -> list:
    """``chunk``'s MoE routers in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in chunk.modules() if isinstance(m, TopKRouter)]


def replay_ready(chunks: Sequence[torch.nn.Module]) -> bool:
    """Every router of ``chunks`` can record and replay (built with routing replay on)."""
    found = [r for c in chunks for r in routers(c)]
    return bool(found) and all(r.router_replay is not None for r in found)


def padding_routing(shape: tuple[int, ...], topk: int, dtype, device=None) -> torch.Tensor:
    """``[*shape, topk]`` of experts ``0..k-1``: the routing of positions nothing recorded
    (right padding, causally invisible to real tokens)."""
    return torch.arange(topk, dtype=dtype, device=device).expand(*shape, topk)


def pad_positions(routing: torch.Tensor, width: int) -> torch.Tensor:
    """Recorded routing ``[n, layers, positions, k]`` cut or right-padded to ``width``
    positions (padding: :func:`padding_routing`)."""
    n, layers, have, k = routing.shape
    if have >= width:
        return routing[:, :, :width]
    return torch.cat([routing, padding_routing((n, layers, width - have), k, routing.dtype)], 2)


class Routing:
    """Recording or replaying one pass's routing over ``chunks``.

    Choices are kept per sequence as ``[rows, layers, positions, k]`` int16: every position
    (prompt too), this pipeline rank's MoE layers in order (all its chunks). A router sees its
    micro-batch's tokens in the model's order (:class:`~megarl.models.packing.TokenOrder`:
    sequence-major when right-padded, packed otherwise), its CP rank's share, under sequence
    parallelism only its TP rank's slice of that. Positions nothing recorded hold experts ``0..k-1`` (padding: causally
    invisible to real tokens). While replaying, each router also counts the real tokens whose
    own top-k set equals the replayed one: ``router_agreement`` (under R3, in the old-log-prob
    forward, ``rollout_corr/router_agreement``: the trainer's routers against vLLM's choices).
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], mode: str) -> None:
        if mode not in ("record", "replay"):
            raise ValueError(f"routing mode {mode!r}: record or replay")
        if not replay_ready(chunks):
            raise ValueError("routing replay needs a MoE model built with routing replay on")
        self.mode = mode
        self.chunks = list(chunks)
        self._routers = [routers(c) for c in self.chunks]
        self._offsets = [sum(len(r) for r in self._routers[:i]) for i in range(len(self.chunks))]
        self.layers = sum(len(r) for r in self._routers)
        self.topk = self._routers[0][0].topk if self.layers else 0
        self.layer_numbers = [r.layer_number - 1 for rs in self._routers for r in rs]
        """Each of this rank's MoE layers as the model's decoder layer (0-based, global)."""
        from megarl.models.gpt import unwrap

        self._sp = bool(unwrap(self.chunks[0]).config.sequence_parallel)
        self.agree = torch.zeros((), dtype=torch.float64)
        self.tokens = torch.zeros((), dtype=torch.float64)
        self._valid: torch.Tensor | None = None
        self.unreplayed: dict[int, torch.Tensor] = {}
        """While a micro-batch replays: ``id(router)`` → its tokens (as the router sees them)
        whose replayed choice was unknown (R3: the last token of each sequence), routed to
        experts ``0..k-1`` only to be routed somewhere (:class:`~megarl.models.expert_load.
        ExpertLoad` leaves them out)."""

    # -- storage -------------------------------------------------------------------------------

    def empty(self, rows: int, width: int) -> torch.Tensor:
        """Storage for ``rows`` sequences of ``width`` positions, every position routed to
        experts ``0..k-1`` until recorded."""
        return padding_routing((rows, self.layers, width), self.topk, torch.int16).clone()

    def from_rollout(self, captured: torch.Tensor) -> torch.Tensor:
        """The rollout's choices ``[rows, positions, model layers, k]`` (-1: nothing routed:
        dense layers, the last generated token, padding) as this pass's storage
        ``[rows, layers, positions, k]``: this rank's MoE layers. A position still -1 is
        replayed as experts ``0..k-1`` (causally invisible: the last token's output predicts
        nothing) and left out of the agreement."""
        if captured.shape[-1] != self.topk:
            raise ValueError(f"rollout routing has top-{captured.shape[-1]}, the model {self.topk}")
        return captured[:, :, self.layer_numbers].transpose(1, 2).to(torch.int16)

    # -- around one micro-batch's forward on one chunk -----------------------------------------

    def before(self, chunk: torch.nn.Module, mb: dict, order: TokenOrder) -> None:
        """Arm the chunk's routers for the micro-batch ``mb``, whose tokens the model sees in
        ``order`` (right-padded or packed, :class:`~megarl.models.packing.TokenOrder`)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        index = self._index(chunk)
        if self.mode == "record":
            for r in self._routers[index]:
                r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
            return
        stored = mb[ROUTING]  # [b, layers, width, k]
        b, width, seq = stored.shape[0], stored.shape[2], order.width
        local = order.local
        at = local.clamp(min=0).to(stored.device)
        real = (local >= 0).to(stored.device) & (at % seq < mb["lengths"][at // seq])
        for i, r in enumerate(self._routers[index]):
            grid = stored[:, self._offsets[index] + i, : min(seq, width)]  # [b, ≤seq, k]
            if seq > width:  # positions past every recorded one: padding
                pad = padding_routing((b, seq - width), self.topk, grid.dtype, grid.device)
                grid = torch.cat([grid, pad], 1)
            choice = grid.reshape(b * seq, self.topk)[at]
            padding = padding_routing(choice.shape[:-1], self.topk, choice.dtype, choice.device)
            choice = torch.where((local < 0).to(choice.device)[:, None], padding, choice)
            unknown = choice[..., :1] < 0  # nothing routed there (R3: the last token)
            if i == 0:
                self._valid = self._local(real & ~unknown[..., 0])
            choice = torch.where(unknown, padding, choice)
            self.unreplayed[id(r)] = self._local(unknown[..., 0])
            target = self._local(choice).long()
            r.router_replay.set_target_indices(target)
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            self._measure(r.router_replay)

    def after(
        self, chunk: torch.nn.Module, stored: torch.Tensor | None, rows, order: TokenOrder
    ) -> None:
        """Disarm the chunk's routers; when recording, write the choices of the micro-batch's
        ``rows`` (seen in ``order``) into ``stored``."""
        index = self._index(chunk)
        recording = self.mode == "record" and stored is not None
        if recording:
            grid = order.grid.reshape(-1).cpu()
            kept = (grid >= 0) & (grid % order.width < stored.shape[2])  # type: ignore[union-attr]
            at_row = rows.cpu()[grid[kept] // order.width]
            at_pos = grid[kept] % order.width
        for i, r in enumerate(self._routers[index]):
            replay = r.router_replay
            if recording:
                chosen = self._full(replay.get_recorded_indices()).cpu()[kept]
                stored[at_row, self._offsets[index] + i, at_pos] = chosen.to(stored)  # type: ignore[index]
            replay.clear_indices()
            replay.clear_router_replay_action()
            replay.__dict__.pop("get_replay_topk", None)
            self.unreplayed.pop(id(r), None)
        self._valid = None

    # -- helpers -------------------------------------------------------------------------------

    def _index(self, chunk: torch.nn.Module) -> int:
        for i, c in enumerate(self.chunks):
            if c is chunk:
                return i
        raise ValueError("routing: a model chunk this pass was not built for")

    def _tp(self) -> tuple[int, int]:
        from megatron.core import parallel_state

        if not self._sp:
            return 0, 1
        return (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
        )

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of the tokens ``[n, ...]`` (in the model's order) under sequence
        parallelism."""
        rank, size = self._tp()
        if size == 1:
            return t
        part = t.shape[0] // size
        return t[rank * part : (rank + 1) * part]

    def _full(self, recorded: torch.Tensor) -> torch.Tensor:
        """A router's recorded ``[tokens, k]`` as every token of the micro-batch in
        :attr:`TokenOrder.grid`'s order: gathered over the TP ranks under sequence parallelism,
        then over the context-parallel ranks."""
        from megatron.core import parallel_state

        local = recorded.reshape(-1, self.topk).contiguous()
        groups = []
        if self._tp()[1] > 1:
            groups.append(parallel_state.get_tensor_model_parallel_group())
        if parallel_state.get_context_parallel_world_size() > 1:
            groups.append(parallel_state.get_context_parallel_group())
        for group in groups:
            parts = [
                torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))
            ]
            torch.distributed.all_gather(parts, local, group=group)
            local = torch.cat(parts)
        return local

    def _measure(self, replay) -> None:
        """Make ``replay`` also count, while replaying, the real tokens whose own choice agrees."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        valid = self._valid

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, compute=None):
            probs, chosen = RouterReplay.get_replay_topk(
                replay, scores, topk, num_groups, group_topk, compute
            )
            with torch.no_grad():
                _, own = compute(scores, topk, num_groups=num_groups, group_topk=group_topk)
                same = (own.sort(-1).values == chosen.sort(-1).values).all(-1)
                if valid is not None and valid.numel() == same.numel():
                    self.agree += float(same[valid.to(same.device)].sum())
                    self.tokens += float(valid.sum())
            return probs, chosen

        replay.get_replay_topk = get_replay_topk
