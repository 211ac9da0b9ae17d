"""The MoE routers' z-loss at full strength at any TP×CP layout.

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
