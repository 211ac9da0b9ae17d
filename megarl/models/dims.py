"""Transitional re-export: :class:`ModelDims` lives in :mod:`megarl.config.model_dims`.

Only files of other branches (``rollout/reshard/executor.py`` and multi-rank test workers)
still import this path; remove the module once they import ``megarl.config.model_dims``.
"""

from megarl.config.model_dims import (
    SUPPORTED_ARCHITECTURES,
    ModelDims,
    UnsupportedArchitectureError,
    padded_vocab_size,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelDims",
    "UnsupportedArchitectureError",
    "padded_vocab_size",
]
