"""This rank's model chunks as the code around the model sees them: unwrapped, and where they live.

Apart from :mod:`megarl.models.gpt` (which re-exports both) so that the modules the builder
itself calls, such as :mod:`megarl.models.router_losses`, can use them without an import circle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.models.gpt import GPTModel


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers down to the ``GPTModel``."""
    while hasattr(model, "module") and not isinstance(model, GPTModel):
        model = model.module
    return model


def chunks_device(chunks: Sequence[torch.nn.Module]) -> torch.device:
    """Device of this rank's model chunks (that of the first chunk's parameters)."""
    return next(unwrap(chunks[0]).parameters()).device
