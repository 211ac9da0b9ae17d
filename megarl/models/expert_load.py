"""Expert load of a Mixture-of-Experts model: how evenly its routers spread the tokens.

While :class:`ExpertLoad` is open, a forward hook on every MoE router sums the routing map it
returns (the experts each token goes to, the replayed ones under routing replay) over the real
tokens into one count per (layer, expert); :meth:`ExpertLoad.metrics` adds the counts over every
rank and summarises them per layer as ``max / mean`` tokens per expert (1: perfectly even).
A forward run again by activation recompute counts again, every layer alike: the ratios hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

import torch

from megarl.models.routing import routers

__all__ = ["ExpertLoad"]


class ExpertLoad:
    """Counts tokens per expert in every MoE layer of ``chunks`` while open (a context manager;
    the hooks go when it closes)."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        from megarl.models.gpt import unwrap

        config = unwrap(chunks[0]).config
        self.num_layers = config.num_layers
        self.num_experts = config.num_moe_experts
        self.sequence_parallel = bool(config.sequence_parallel)
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self._routers = [r for c in chunks for r in routers(c)]
        self._hooks: list = []
        self.replaying = None
        """The replaying :class:`~megarl.models.routing.Routing` of the forwards being counted,
        if any: tokens it routed without a known choice are not counted."""

    def __enter__(self) -> Self:
        for router in self._routers:
            self._hooks.append(router.register_forward_hook(self._hook(router.layer_number - 1)))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _hook(self, layer: int):
        def count(module, args, output) -> None:
            routing_map = output[1].detach()  # [tokens, experts]
            padding = args[1] if len(args) > 1 else None  # [s, b], True: padding
            if padding is not None:  # the router's own tokens (its sequence slice under SP)
                routing_map = routing_map & ~padding.reshape(-1, 1).to(routing_map.device)
            unknown = self.replaying.unreplayed.get(id(module)) if self.replaying else None
            if unknown is not None and unknown.numel() == routing_map.shape[0]:
                routing_map = routing_map & ~unknown.reshape(-1, 1).to(routing_map.device)
            self.counts[layer] += routing_map.sum(0).to(torch.float64).cpu()

        return count

    def metrics(self) -> dict[str, float]:
        """The load summary over every rank (collective: call it on every rank).

        ``expert_load_imbalance``: the mean over the MoE layers of max / mean tokens per expert;
        ``expert_load_imbalance_max``: the worst layer's, and ``expert_load_worst_layer`` its
        (0-based decoder layer) index; ``expert_load_idle``: the share of (layer, expert) pairs
        that received no token. Each pipeline stage counts its own layers.
        """
        from megatron.core import parallel_state

        from megarl.parallel.init import device

        total = self.counts.to(device())
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        if not self.sequence_parallel:  # then a TP group's ranks all saw the same tokens
            total /= parallel_state.get_tensor_model_parallel_world_size()
        total = total.cpu()
        moe = total.sum(1) > 0  # dense layers, and MoE layers nobody counted, are left out
        if not bool(moe.any()):
            return {}
        per_layer = total.max(1).values / total.mean(1).clamp(min=1e-12)
        worst = int(torch.where(moe, per_layer, -1.0).argmax())
        return {
            "expert_load_imbalance": float(per_layer[moe].mean()),
            "expert_load_imbalance_max": float(per_layer[worst]),
            "expert_load_worst_layer": float(worst),
            "expert_load_idle": float((total[moe] == 0).to(torch.float64).mean()),
        }
