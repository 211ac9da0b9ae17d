"""The one table of dtype spellings: the config's and CLIs' short names (``bf16``), torch's, HF's
and vLLM's names (``bfloat16``), and safetensors header codes (``BF16``).

Torch-free (``torch_dtype`` imports torch when called), so launchers and input checks use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES: dict[str, str] = {
    alias: name
    for short, name in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"))
    for alias in (short, name)
}
"""Every accepted spelling -> the torch / HF / vLLM name."""

SHORT_NAMES: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""The config's and the command lines' spellings."""

SAFETENSORS_DTYPE_NAMES: dict[str, str] = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
"""safetensors header ``dtype`` codes of the floating-point dtypes megarl converts."""


def dtype_name(dtype: str | torch.dtype) -> str:
    """``float32`` / ``bfloat16`` / ``float16`` for any accepted spelling or torch dtype;
    ``ValueError`` naming the dtype otherwise."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(
            f"unsupported dtype {dtype!r}: use bf16, fp32 or fp16 (or bfloat16, float32, float16)"
        )
    return DTYPE_NAMES[name]


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype of any accepted spelling."""
    import torch

    return getattr(torch, dtype_name(dtype))
