"""The MoE routers' losses: the z-loss at full strength at any TP×CP layout, and their values per
micro-batch as the runner reports them (:class:`AuxLosses`).

Under ``calculate_per_token_loss`` (megarl always trains with it) ``finalize_model_grads`` divides
every gradient by the mini-batch's tokens, so each router attaches its loss times the tokens it
stands for, and the routers' gradients are summed over TP×CP. Megatron-Core 0.16.1 attaches the
z-loss as ``coeff / (TP×CP)`` times the mean over the rank's sequence slice times the slice's
tokens: summed over the group, 1/(TP×CP) of the coefficient (Megatron-LM #5047 fixed it in core
0.19). :func:`install` attaches ``coeff × Σ logsumexp²`` over the rank's real tokens instead,
which sums to the micro-batch's loss times its tokens, and tracks that sum coefficient-free (the
runner's aux-loss shares divide it by the tokens).

The load-balancing loss (``aux_loss``) needs no change on megarl's path: with the routers'
padding mask, which the runner always passes, Megatron counts the micro-batch's tokens over the
group (its all-reduce of the token counts is in place), the exact scale. The test of both:
``tests/models/test_moe_models.py::test_router_losses_have_their_full_strength_at_every_layout``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.models.chunks import chunks_device

_INSTALLED = False


def install() -> None:
    """Replace Megatron's z-loss attachment by the one above (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.core.transformer.moe.router import TopKRouter as Router

    original_z_loss = Router.apply_z_loss

    def apply_z_loss(self, logits, padding_mask=None):
        coeff = self.config.moe_z_loss_coeff
        if not self.calculate_per_token_loss or coeff is None:
            return original_z_loss(self, logits, padding_mask=padding_mask)
        if not (self.training and torch.is_grad_enabled()):
            return logits
        from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        squares = torch.logsumexp(logits, dim=-1).square()
        if padding_mask is not None:  # True: padding
            squares = squares * (~padding_mask)
        total = squares.sum()
        logits = MoEAuxLossAutoScaler.apply(logits, coeff * total)
        layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        save_to_aux_losses_tracker("z_loss", total.detach(), self.layer_number, layers)
        return logits

    Router.apply_z_loss = apply_z_loss
    _INSTALLED = True


AUX_LOSS_NAMES = {
    "load_balancing_loss": "moe_aux_loss",
    "seq_load_balancing_loss": "moe_seq_aux_loss",
    "global_load_balancing_loss": "moe_global_aux_loss",
    "z_loss": "moe_z_loss",
}
"""Megatron's aux-loss tracker names -> megarl's metric names."""


class AuxLosses:
    """The MoE routers' auxiliary losses of each micro-batch of one pass, read from Megatron's
    aux-loss tracker around each forward of a model chunk (the tracker holds per layer the
    coefficient-free values its routers added; names as Megatron's router logs them).

    Megatron computes them (``moe_aux_loss_coeff``, z-loss) per micro-batch over its unpadded
    tokens and, under ``calculate_per_token_loss``, weights each by that token count: the
    objective is their token-weighted mean over the mini-batch. They are reported as
    ``moe_aux_loss``, ``moe_z_loss``, ...: coefficient-free, averaged over the MoE layers, as
    per-micro-batch shares that sum to that mean.
    """

    def __init__(self, micro_batches: int) -> None:
        self.sums: dict[str, list[float]] = {k: [0.0] * micro_batches for k in AUX_LOSS_NAMES}

    def before(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()

    def after(self, index: int, tokens: float) -> None:
        """Add micro-batch ``index``'s values (summed over this chunk's layers) × its tokens; the
        z-loss is tracked as its sum over the rank's tokens already
        (:mod:`megarl.models.router_losses`)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        for name, entry in get_moe_layer_wise_logging_tracker().items():
            if name in AUX_LOSS_NAMES:
                weight = 1.0 if name == "z_loss" else tokens
                self.sums[name][index] += float(entry["values"].sum()) * weight

    def add_shares(self, metrics: list[dict], chunks: list, total_tokens: float) -> None:
        """Put each micro-batch's share of the token-weighted mean (over the mini-batch's
        ``total_tokens``, per MoE layer) into its metrics; summed over the pipeline stages and
        tensor×context-parallel ranks (whose routers each add a part, Megatron's reduction)."""
        from megatron.core.transformer.moe.router import Router

        keys = list(AUX_LOSS_NAMES)  # the same on every rank: the tensor is reduced
        t = torch.tensor(
            [self.sums[k][i] for k in keys for i in range(len(metrics))]
            + [sum(isinstance(m, Router) for c in chunks for m in c.modules())],
            dtype=torch.float64,
            device=chunks_device(chunks),
        )
        for group in (
            parallel_state.get_pipeline_model_parallel_group(),
            parallel_state.get_tensor_and_context_parallel_group(),
        ):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(t, group=group)
        values, layers = t[:-1].view(len(keys), len(metrics)).tolist(), float(t[-1])
        # Every TP×CP rank of a stage holds the same routers: count each stage's once.
        layers /= parallel_state.get_tensor_and_context_parallel_world_size()
        for k, row in zip(keys, values, strict=True):
            if not any(row):
                continue  # that loss is off
            for m, value in zip(metrics, row, strict=True):
                m[AUX_LOSS_NAMES[k]] = value / (total_tokens * layers)
