"""The weight sync's executor on this device, for ``tools/gpu_check.py --bare-node``
(:func:`measure`, in a world of one; or ``python tools/gpu_reshard.py MODEL_DIR cuda|cpu``).

Builds the Megatron actor from the HF checkpoint (bf16 on CUDA), runs ``sync_weights`` into an
engine stand-in that compares every received tensor with the checkpoint's (exact), twice (the
first warms up), and writes: tensors received, mismatched names, bytes received against the
plan's, seconds (CUDA-synchronised) and GB/s against a device-to-device copy of those bytes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


class CheckingSink:
    """Takes a weight update as vLLM's TP rank 0 would; every tensor is compared with the HF
    checkpoint's own (in the model's dtype, on its device)."""

    def __init__(self, reference: dict[str, torch.Tensor]) -> None:
        self.reference = reference
        self.received: dict[str, int] = {}
        self.mismatched: list[str] = []

    def begin_weight_update(self) -> None:
        self.received = {}

    def load_weight_chunk(self, named_tensors) -> None:
        for name, tensor in named_tensors:
            expected = self.reference.get(name)
            if expected is None or not torch.equal(tensor, expected.to(tensor)):
                self.mismatched.append(name)
            self.received[name] = tensor.numel() * tensor.element_size()

    def finish_weight_update(self) -> None:
        pass


def measure(model: str, device: str) -> dict:
    from safetensors.torch import load_file

    from megarl.models.build import build_model
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.rollout.reshard import plan_for_chunks, sync_weights

    cuda = device == "cuda"
    layout = ParallelLayout()
    init_distributed(layout)
    dtype = torch.bfloat16 if cuda else torch.float32
    built = build_model(model, layout, dtype=dtype, transformer_impl="local")
    on = "cuda" if cuda else "cpu"
    reference = {}
    for file in sorted(Path(model).glob("*.safetensors")):
        reference.update({k: v.to(on, dtype) for k, v in load_file(str(file)).items()})
    plan = plan_for_chunks(built.chunks, built.dims, 1)
    sink = CheckingSink(reference)
    sync_weights(built.chunks, plan, sink)  # warm-up: allocator, first kernels
    sink.mismatched = []
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    stats = sync_weights(built.chunks, plan, sink)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    nbytes = sum(sink.received.values())
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check import _copy_gbps

    # tied embeddings: the checkpoint has no lm_head.weight, and vLLM's loader ties it itself
    missing = sorted(set(reference) - set(sink.received))
    result = {
        "shape": {"layers": built.dims.num_layers, "hidden": built.dims.hidden_size},
        "dtype": str(dtype), "tensors": len(sink.received), "mismatched": sink.mismatched,
        "not_received": missing, "bytes": nbytes, "plan_bytes": plan.hf_bytes,
        "buffer_bytes": stats.bytes, "plan_buffer_bytes": plan.total_bytes,
        "buckets": stats.buckets, "sync_s": seconds, "sync_gbps": nbytes / seconds / 1e9,
        "copy_gbps": _copy_gbps(nbytes, cuda),
    }  # fmt: skip
    del built, reference, sink
    destroy_distributed()
    if cuda:
        torch.cuda.empty_cache()  # the trainer runs after this one get the GPU back
    return result


if __name__ == "__main__":
    print(json.dumps(measure(*sys.argv[1:3]), indent=1))
