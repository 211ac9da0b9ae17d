"""Stand-in for ``megarl.trainer`` under the Slurm script: a gloo all-reduce over torchrun's world.

Prints ``rank R of W: sum S, args ...`` per rank and exits with ``$PAYLOAD_EXIT`` (default 0).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    print(
        f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {value.item():g}, "
        f"args {' '.join(sys.argv[1:])}",
        flush=True,
    )
    print(f"rank {dist.get_rank()} CUDA_DEVICE_MAX_CONNECTIONS="
          f"{os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}", flush=True)  # fmt: skip
    dist.destroy_process_group()
    sys.exit(int(os.environ.get("PAYLOAD_EXIT", "0")))
