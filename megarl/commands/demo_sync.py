"""Demo step: a Megatron actor and a vLLM engine in one torchrun world, kept in sync.

    torchrun --nproc_per_node 2 -m megarl.commands.demo_sync --model outputs/tiny-qwen2

Builds the actor at ``--tp``×``--pp`` and vLLM at ``--rollout-tp`` in the same processes, then:
generate and compare vLLM's log-probs with the actor's → perturb the actor (seeded noise) →
generate (vLLM's stale weights: a large difference) → sync Megatron → vLLM → generate (float32
noise). Exits non-zero unless the synced difference is within ``--atol`` and the stale one far
above it.
"""

from __future__ import annotations

import argparse
import sys
import zlib

import torch
import torch.distributed as dist


def _print0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="megarl.commands.demo_sync", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--tp", type=int, default=2, help="actor tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="actor pipeline parallel size")
    p.add_argument("--rollout-tp", type=int, default=2, help="vLLM tensor parallel size")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--noise", type=float, default=0.02, help="std of the weight perturbation")
    p.add_argument("--atol", type=float, default=1e-4, help="allowed max |Δ log-prob| after sync")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from megatron.core import parallel_state

    from megarl.models.build import build_model
    from megarl.models.weights import local_global_names
    from megarl.parallel.collectives import max_over_ranks
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.rollout.consistency import DIFF_MAX, DIFF_MEAN, rollout_logprob_consistency
    from megarl.rollout.distribute import generate_distributed
    from megarl.rollout.reshard import plan_for_chunks, sync_weights
    from megarl.rollout.vllm_engine import VLLMEngine

    layout = ParallelLayout(args.tp, args.pp)
    init_distributed(layout, seed=0, rollout_tp=args.rollout_tp)  # the sync's pipeline pairs
    built = build_model(args.model, layout)
    dims, chunks = built.dims, built.chunks
    _print0(
        f"actor: {dims.architecture}, TP={args.tp} PP={args.pp}; starting vLLM TP={args.rollout_tp}"
    )
    engine = VLLMEngine(
        args.model,
        tensor_parallel_size=args.rollout_tp,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=32 << 20,
        seed=0,
    )
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    g = torch.Generator().manual_seed(dp_rank)
    prompts = [
        torch.randint(4, dims.vocab_size, (int(k),), generator=g).tolist() for k in (5, 8, 3, 6)
    ]

    def rollout_and_compare(step: int, label: str) -> dict[str, float]:
        batch = generate_distributed(
            engine,
            prompts,
            dp_rank=dp_rank,
            dp_size=dp_size,
            n=2,
            temperature=args.temperature,
            max_tokens=16,
            seed=1,
            step=step,
        )
        m = rollout_logprob_consistency(
            chunks, batch, vocab_size=dims.vocab_size, temperature=args.temperature
        )
        # On the run's device: the default group is NCCL on a GPU (no CPU tensors).
        mean, most = max_over_ranks([m[DIFF_MEAN], m[DIFF_MAX]])
        tokens = sum(len(s.response_token_ids) for s in batch)
        _print0(
            f"{label:<34} {tokens:4d} tokens  |Δ log-prob| vLLM vs actor: "
            f"mean {mean:.2e}  max {most:.2e}"
        )
        return {"mean": mean, "max": most}

    rollout_and_compare(0, "initial weights")
    with torch.no_grad():
        for _chunk, _local, name, param in local_global_names(chunks):
            noise_gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            noise = torch.randn(param.shape, generator=noise_gen) * args.noise  # CPU: seeded
            param.add_(noise.to(param.device, param.dtype))
    stale = rollout_and_compare(1, "actor perturbed, vLLM not synced")
    plan = plan_for_chunks(chunks, dims, rollout_tp=args.rollout_tp)
    stats = sync_weights(chunks, plan, engine)
    _print0(
        f"sync: {stats.buckets} buckets, {stats.bytes / 2**20:.1f} MiB in {stats.seconds:.3f} s "
        f"({stats.bytes_per_s / 2**20:.0f} MiB/s)"
    )
    synced = rollout_and_compare(2, "after sync")
    ok = synced["max"] <= args.atol and stale["max"] > 100 * max(synced["max"], 1e-7)
    _print0(f"weight sync {'OK' if ok else 'FAILED'} (atol {args.atol:g})")
    engine.shutdown()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
