"""LoRA on the GPU path (issue 54): adapters created on the device of the weight they adapt
(so the non-distributed optimizer, the first broadcast and ``megarl convert``'s merge run), and
the adapter-only sync's whole-model gather sending its objects over gloo, not NCCL.

Skipped without CUDA (conftest). In-process, a world of one on NCCL.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_lora(tmp_path_factory):
    from megarl.models.build import build_model
    from megarl.models.lora import LoraSettings, attach_adapters, freeze_base
    from megarl.models.tiny import make_tiny_model
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.parallel.spawn import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_distributed(ParallelLayout(1, 1))
    path = make_tiny_model(tmp_path_factory.mktemp("lora_gpu") / "qwen2", family="qwen2")
    built = build_model(path, ParallelLayout(1, 1), dtype=torch.float32, transformer_impl="local")
    settings = LoraSettings(rank=4, alpha=1.6, b_init="normal", seed=5, target_modules=())
    attach_adapters(built.chunks, settings)
    freeze_base(built.chunks)
    return built


def test_adapters_are_on_the_gpu_and_train_and_merge_there(cuda_lora):
    from megarl.models.lora import adapted_linears, merged_weights
    from megarl.models.runner import SequenceBatch, forward_backward

    linears = [lin for _, _, lin in adapted_linears(cuda_lora.chunks)]
    assert linears and all(
        lin.lora.A.is_cuda and lin.lora.B.is_cuda and lin.weight.is_cuda for lin in linears
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cuda_lora.dims.vocab_size, (2, 12), generator=g)
    seqs = SequenceBatch(ids, torch.tensor([3, 4]), torch.tensor([12, 10]),
                         extra={"w": torch.randn(2, 9, generator=g)})  # fmt: skip

    def loss_fn(outputs, mb):
        return (outputs["log_probs"] * mb["w"]).sum(), {}

    forward_backward(cuda_lora.chunks, seqs, loss_fn, micro_batches=1,
                     vocab_size=cuda_lora.dims.vocab_size)  # fmt: skip
    assert all(lin.lora.A.grad is not None and lin.lora.A.grad.is_cuda for lin in linears)
    merged = merged_weights(cuda_lora.chunks)  # megarl convert's merge: CUDA weight + delta
    assert merged and all(t.is_cuda for t in merged.values())


def test_the_adapter_gather_stages_nothing_on_the_gpu(cuda_lora):
    """Over NCCL ``all_gather_object`` copies the pickled payload to the GPU (world × the
    largest); over gloo the gather's GPU memory peak stays below the adapters' bytes."""
    import torch.distributed as dist

    from megarl.models.lora import adapter_parameters
    from megarl.models.lora_peft import every_stage_adapters

    assert dist.get_backend() == "nccl"
    payload = sum(p.numel() * p.element_size() for p in adapter_parameters(cuda_lora.chunks))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    state, _ = every_stage_adapters(cuda_lora.chunks, cuda_lora.dims)
    torch.cuda.synchronize()
    assert state and torch.cuda.max_memory_allocated() - before < payload // 2
