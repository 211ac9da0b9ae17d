"""Check that a Megatron model computes the same logits as its Hugging Face counterpart.

Seeded random sequences go through the Megatron model (any TP×PP×VPP layout,
:func:`megatron_logits`) and through the HF model in ``transformers`` (:func:`hf_logits`), both
in float32 with both sides' weights rounded to the coarser stored dtype (:func:`round_params`),
so a bf16 checkpoint is compared exactly. :func:`compare_with_hf` reports ``max |Δlogit|``
against ``atol + rtol · max|logit|``; one rank loads the HF model on the CPU in float32 (4 bytes
per parameter). Used by ``megarl convert ... --verify`` and ``megarl convert verify``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.models.gpt import chunks_device
from megarl.models.runner import forward_logits, gather_vocab
from megarl.parallel.init import device


@dataclass(frozen=True)
class LogitComparison:
    """Outcome of :func:`compare_with_hf` (the same on every rank)."""

    max_diff: float
    """max |Megatron logit - HF logit| over all sequences, positions and vocabulary entries."""
    max_logit: float
    """max |HF logit|, the scale ``rtol`` is relative to."""
    tolerance: float
    """``atol + rtol · max_logit``."""
    num_sequences: int
    """How many sequences were compared."""
    num_tokens: int
    """Their total length."""
    vocab_size: int
    """Logits per token (the HF vocabulary, without Megatron's padding)."""

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.tolerance

    def summary(self) -> str:
        """One line: the difference, what was compared, the tolerance and the verdict."""
        return (
            f"max |Δlogit| = {self.max_diff:.3e} over {self.num_sequences} sequences "
            f"({self.num_tokens} tokens × {self.vocab_size} vocab; max |logit| "
            f"{self.max_logit:.3g}); tolerance {self.tolerance:.3e}: "
            f"{'OK' if self.ok else 'MISMATCH'}"
        )


def verify_inputs(
    vocab_size: int, num_sequences: int, seq_len: int, seed: int
) -> list[torch.Tensor]:
    """Seeded random token sequences, longest first, of different lengths (>= 2 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [
        max(2, seq_len - i * max(1, seq_len // (2 * num_sequences))) for i in range(num_sequences)
    ]
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]


def coarser_dtype(a: str, b: str) -> str:
    """The less precise of two dtype names (float32 loses to either 16-bit type)."""
    return b if a == "float32" else a


@torch.no_grad()
def round_params(params: Iterable[torch.Tensor], dtype_name: str) -> None:
    """Round each tensor in place to ``dtype_name`` precision (keeping its own dtype)."""
    if dtype_name == "float32":
        return
    for p in params:
        p.copy_(p.to(getattr(torch, dtype_name)).to(p.dtype))


@torch.no_grad()
def megatron_logits(
    chunks: Sequence[torch.nn.Module], sequences: Sequence[torch.Tensor], vocab_size: int
) -> list[torch.Tensor] | None:
    """Full-vocabulary float32 logits ``[len_i, vocab_size]`` per sequence (CPU tensors).

    Forward-only through Megatron's schedule (one sequence per micro-batch); the vocab-parallel
    logits are gathered over TP and the padding trimmed. Collective; returns None off the last
    pipeline stage.
    """
    dev = chunks_device(chunks)
    kept = forward_logits(chunks, [s.to(dev)[None] for s in sequences])
    if kept is None:
        return None
    return [gather_vocab(local[0], vocab_size).cpu() for local in kept]


@torch.no_grad()
def hf_logits(
    hf_path: str | Path, sequences: Sequence[torch.Tensor], round_to: str
) -> list[torch.Tensor]:
    """float32 logits of the HF model (``transformers``, CPU), weights rounded to ``round_to``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_path, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    )
    model.eval()
    round_params(model.parameters(), round_to)
    return [model(input_ids=s[None]).logits[0].float() for s in sequences]


def compare_with_hf(
    logits: list[torch.Tensor] | None,
    hf_path: str | Path,
    sequences: Sequence[torch.Tensor],
    *,
    vocab_size: int,
    round_to: str,
    atol: float,
    rtol: float,
) -> LogitComparison:
    """Compare :func:`megatron_logits`' result with the HF model's logits (collective).

    One rank holding ``logits`` (TP rank 0, DP rank 0 of the last stage) runs the HF model; the
    outcome is shared with every rank. Free the Megatron model before calling: the HF model is
    loaded beside whatever is still in memory.
    """
    reporter = (
        logits is not None
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    # [max |Δ|, max |logit|] from the reporting rank; the others contribute -1 to the MAX.
    result = torch.full((2,), -1.0, dtype=torch.float64, device=device())
    if reporter:
        ref = hf_logits(hf_path, sequences, round_to)
        diff = max(float((m - r).abs().max()) for m, r in zip(logits, ref, strict=True))
        scale = max(float(r.abs().max()) for r in ref)
        result = torch.tensor([diff, scale], dtype=torch.float64, device=device())
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    diff, scale = result.tolist()
    return LogitComparison(
        max_diff=diff,
        max_logit=scale,
        tolerance=atol + rtol * scale,
        num_sequences=len(sequences),
        num_tokens=sum(len(s) for s in sequences),
        vocab_size=vocab_size,
    )
