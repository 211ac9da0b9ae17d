"""NCCL's communicators exist before the first memory-heavy phase (GPU only; skipped on CPU).

Seen on an H100 (2026-11-27, tools/gpu_check.py): a trainer step failed at its first
gradient-norm all-reduce with "Failed to CUDA calloc async 4 bytes": the generation before it
had left PyTorch's caching allocator holding the GPU, and NCCL, creating that group's
communicator lazily, allocates outside the cache. ``init_distributed`` now connects every
Megatron group at set-up (``megarl.parallel.init.connect_groups``), while the GPU is empty.
This launch reproduces the sequence: set-up, the cache filled to the last GiB and released to
the cache (not to the driver), then the first collectives on Megatron's groups.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.gpu


def test_collectives_run_after_the_cache_has_taken_the_gpu():
    out = run_torchrun(Path(__file__), 1, ["--worker"], timeout=300)
    assert "collectives ok" in out, out[-2000:]


def _worker() -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    init_distributed(ParallelLayout())
    assert dist.get_backend() == "nccl"
    blocks = []
    try:
        while True:
            blocks.append(torch.empty(2**30, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        pass
    filled = torch.cuda.memory_reserved()
    del blocks  # back to PyTorch's cache, which keeps the GPU
    assert torch.cuda.memory_reserved() == filled
    t = torch.ones(4, device="cuda")
    from megarl.parallel.collectives import max_over_ranks
    from megarl.parallel.connect import _collective_groups

    for _name, group in _collective_groups():  # every group a step uses (connect_groups' list)
        dist.all_reduce(t, group=group)
    for group in (ps.get_model_parallel_group(), ps.get_data_parallel_group(), None):
        dist.all_reduce(t, group=group)
    # demo_sync's reduction: on NCCL a CPU tensor fails (issue 54 item 3)
    assert max_over_ranks([1.0, 2.0]) == [1.0, 2.0]
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # set before CUDA started (item 7)
    torch.cuda.synchronize()
    print(f"collectives ok with {filled / 2**30:.1f} GiB in the cache", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
