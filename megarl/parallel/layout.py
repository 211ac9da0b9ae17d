"""The one description of a Megatron parallel layout, and the rule for which layouts are legal.

Data parallelism is not stored: it is what remains of the world after TP × PP × CP.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """Model-parallel grid sizes of one model (Megatron's names)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank (1 without the interleaved schedule)."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    def model_parallel_size(self) -> int:
        """Ranks of one data-parallel replica: TP × PP × CP."""
        return self.tp * self.pp * self.cp

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel replicas in a world of ``world_size`` ranks (ValueError if not whole)."""
        if world_size % self.model_parallel_size():
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size × "
                f"pipeline_model_parallel_size × context_parallel_size = "
                f"{self.tp}×{self.pp}×{self.cp}"
            )
        return world_size // self.model_parallel_size()
