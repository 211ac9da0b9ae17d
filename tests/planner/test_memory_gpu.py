"""The memory planner against ``torch.cuda.max_memory_allocated`` (GPU only; skipped on CPU).

A mid-sized bf16 model (TE spec when Transformer Engine imports, else local), distributed
optimizer, one training micro-batch and one optimizer step at TP = PP = DP = 1: the measured
peak is within 15% of the planner's update phase (model state + activations peak).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config.model_dims import ModelDims
from megarl.models.tiny import tiny_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.planner.activations import training_activations
from megarl.planner.memory import OptimizerAssumptions, model_state
from tests.conftest import run_torchrun

WORKER = Path(__file__).with_name("_memory_worker.py")
MODEL = {
    "num_layers": 4,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2816,
    "vocab_size": 32000,
}
BATCH = (2, 2048)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """One GPU launch of the memory worker for both tests."""
    tmp = tmp_path_factory.mktemp("memory_gpu")
    spec = {"tmp": str(tmp), "gpu_model": MODEL, "gpu_batch": list(BATCH)}
    (tmp / "spec.json").write_text(json.dumps(spec))
    run_torchrun(WORKER, 1, [str(tmp / "spec.json"), "--gpu"])
    (result,) = json.loads((tmp / "memory_gpu.json").read_text())
    return result


@pytest.mark.gpu
def test_update_peak_within_15_percent_of_max_memory_allocated(measured):
    impl = measured["impl"]
    dims = ModelDims.from_hf_config(tiny_hf_config("qwen2", **MODEL))
    opt = OptimizerAssumptions(adam="fused" if impl == "transformer_engine" else "torch", impl=impl)
    state = model_state(dims, ParallelLayout(), 1, "actor", opt)
    act = training_activations(
        dims,
        ParallelLayout(),
        micro_batch=BATCH[0],
        seq_len=BATCH[1],
        micro_batches=1,
        dtype="bf16",
        impl=impl,
    )
    planned = state.total + act.peak
    live = "\n".join(
        f"{size / 2**20:9.1f} MiB  {where}" for size, where in measured["live_at_peak"]
    )
    assert abs(planned - measured["peak"]) <= 0.15 * measured["peak"], (
        f"planned {planned}, measured {measured['peak']} ({impl}); live at the peak:\n{live}"
    )


@pytest.mark.gpu
def test_offloading_everything_frees_the_model_state_and_restores_the_weights(measured):
    """``TrainableModel.place`` (the residency schedule's moves) on a GPU: the device memory
    freed is the planner's model state (params, fp32 gradient buffers, main params, Adam), within
    10%, the reload allocates it again, and the weights come back bit-identical."""
    impl = measured["impl"]
    dims = ModelDims.from_hf_config(tiny_hf_config("qwen2", **MODEL))
    opt = OptimizerAssumptions(adam="fused" if impl == "transformer_engine" else "torch", impl=impl)
    state = model_state(dims, ParallelLayout(), 1, "actor", opt)
    assert abs(measured["offload_freed"] - state.total) <= 0.1 * state.total, (measured, state)
    assert abs(measured["reload_allocated"] - state.total) <= 0.1 * state.total, measured
    assert measured["weights_restored"]
