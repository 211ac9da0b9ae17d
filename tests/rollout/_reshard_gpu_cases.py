"""The CUDA suites of tests/rollout/_reshard_worker.py (``--suite gpu`` and ``gpu_ep``), apart
from the CPU ones: bf16 sleep/wake with vLLM's parameter addresses on one GPU, and vLLM's expert
parallelism on two (vLLM's CPU MoE kernel cannot run it)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from tests.rollout._reshard_worker import PROMPTS, SAMPLING, T, build, case_key, perturb


def gpu_suite(models: Path) -> dict:
    """bf16 on one GPU: sleep → sync (wakes weights) → wake KV → generate; vLLM parameter
    storage addresses must not move (CUDA graphs captured on them stay valid)."""
    from megarl.rollout.consistency import rollout_logprob_consistency
    from megarl.rollout.reshard import plan_for_chunks, sync_weights
    from megarl.rollout.vllm_engine import VLLMEngine

    path = str(models / "tiny")
    dims, chunks = build(path, 1, 1, None, dtype=torch.bfloat16)
    engine = VLLMEngine(
        path,
        tensor_parallel_size=1,
        max_model_len=64,
        dtype="bfloat16",
        gpu_memory_utilization=0.2,
        free_cache_engine=True,
        enforce_eager=False,
    )

    def addresses(worker):
        model = worker.model_runner.get_model()
        return {n: p.data_ptr() for n, p in model.named_parameters()}

    (before_ptrs,) = engine._llm.collective_rpc(addresses)
    perturb(chunks, dims, 7, scale=0.05)
    before = engine.generate(PROMPTS, **SAMPLING)
    out = {
        "before": rollout_logprob_consistency(
            chunks, before, vocab_size=dims.vocab_size, temperature=T
        )
    }
    engine.sleep()
    out["asleep"] = engine.is_sleeping
    plan = plan_for_chunks(chunks, dims, 1, bucket_bytes=256 << 10)
    torch.cuda.synchronize()
    stats = sync_weights(chunks, plan, engine)
    engine.wake_up(["kv_cache"])
    (after_ptrs,) = engine._llm.collective_rpc(addresses)
    after = engine.generate(PROMPTS, **SAMPLING)
    out["after"] = rollout_logprob_consistency(
        chunks, after, vocab_size=dims.vocab_size, temperature=T
    )
    out["addresses_unchanged"] = before_ptrs == after_ptrs
    out["num_params"] = len(before_ptrs)
    out["sync_s"] = stats.seconds
    engine.shutdown()
    return out


def gpu_ep_suite(models: Path) -> dict:
    """Two GPUs: vLLM TP 2 with expert parallelism (each rank 4 whole experts of 8) synced from
    the actor at EP 2 and at PP 2 (where each rank receives only its own experts), unreceived
    elements NaN; vLLM's log-probs against the actor's after each sync (fp32)."""
    from megarl.rollout.consistency import rollout_logprob_consistency
    from megarl.rollout.reshard import plan_for_chunks, sync_weights
    from megarl.rollout.vllm_engine import VLLMEngine

    path = str(models / "moe")
    out: dict = {}
    layouts = [(1, 1, None, 2, None), (1, 2, None)]
    dims, chunks = build(path, *layouts[0])
    engine = VLLMEngine(
        path,
        tensor_parallel_size=2,
        max_model_len=64,
        dtype="float32",
        gpu_memory_utilization=0.2,
        expert_parallel=True,
    )
    for i, layout in enumerate(layouts):
        if i:
            del chunks
            gc.collect()
            dims, chunks = build(path, *layout)
        perturb(chunks, dims, 40 + i)
        plan = plan_for_chunks(chunks, dims, 2, bucket_bytes=256 << 10, rollout_ep=True)
        sync_weights(chunks, plan, engine, fill_unsent=float("nan"))
        after = engine.generate(PROMPTS, **SAMPLING)
        out[case_key("moe", layout, 2)] = rollout_logprob_consistency(
            chunks, after, vocab_size=dims.vocab_size, temperature=T
        )
    engine.shutdown()
    return out
