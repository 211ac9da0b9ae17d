"""torchrun worker for tests/rollout/test_remote_sync.py: a split launch of 3 processes, ranks 0-1
training (Megatron), rank 2 a vLLM engine (TP 1) on its own (megarl.parallel.split_world).

For each training layout (TP 2, then PP 2): perturb the actor (the same seeded noise on both
training ranks), let vLLM generate with the weights it holds, send the actor's weights
(megarl.rollout.reshard.remote), generate the same requests again, and bring both rollouts to
the training ranks, which compare vLLM's log-probs with the actor's. Training rank 0 writes
``OUT/remote.json``.

    torchrun --nproc_per_node 3 _remote_worker.py MODEL OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.rollout._reshard_worker import PROMPTS, SAMPLING, T, perturb

LAYOUTS = [(2, 1), (1, 2)]


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    from megarl.config.model_dims import ModelDims, read_hf_config
    from megarl.parallel.split_world import broadcast_object, split_world
    from megarl.rollout.reshard.make_plan import make_reshard_plan
    from megarl.rollout.reshard.remote import receive_weights, send_weights

    world = split_world(2)
    weights = world.group("weights", [0, *world.rollout_ranks])
    result: dict = {"ranks": [world.rank, world.role, torch.distributed.get_world_size()]}
    engine = None
    if world.role == "rollout":
        from megarl.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(model, tensor_parallel_size=1, seed=0, max_model_len=64,
                            dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=16)  # fmt: skip
    for i, (tp, pp) in enumerate(LAYOUTS):
        key = f"tp{tp}_pp{pp}"
        if world.role == "train":
            from megarl.rollout.consistency import rollout_logprob_consistency
            from megarl.rollout.reshard import plan_for_chunks
            from tests.rollout._reshard_worker import build

            dims, chunks = build(model, tp, pp, None)
            perturb(chunks, dims, 50 + i)
            plan = plan_for_chunks(chunks, dims, 1, bucket_bytes=256 << 10)
            broadcast_object(world.bridge, {"tp": tp, "plan_buckets": len(plan.buckets)}, 0)
            before = broadcast_object(world.bridge, None, 2)
            stats = send_weights(chunks, plan, weights)
            received = broadcast_object(world.bridge, None, 2)
            after = broadcast_object(world.bridge, None, 2)
            consistency = {
                tag: rollout_logprob_consistency(
                    chunks, batch, vocab_size=dims.vocab_size, temperature=T
                )
                for tag, batch in (("before", before), ("after", after))
            }
            result[key] = {**consistency, "received": received, "planned_bytes":
                           sum(sum(s.numel for s in b.slots) for b in plan.buckets) * 4,
                           "sent_buckets": stats.buckets}  # fmt: skip
        else:
            layout_info = broadcast_object(world.bridge, None, 0)
            dims = ModelDims.from_hf_config(read_hf_config(model), tp_size=layout_info["tp"])
            from megarl.parallel.layout import ParallelLayout

            plan = make_reshard_plan(dims, ParallelLayout(tp, pp), 1, bucket_bytes=256 << 10,
                                     dtype=torch.float32)  # fmt: skip
            assert len(plan.buckets) == layout_info["plan_buckets"]
            broadcast_object(world.bridge, engine.generate(PROMPTS, **SAMPLING), 2)
            received = receive_weights(engine, plan, weights)
            broadcast_object(world.bridge, received, 2)
            broadcast_object(world.bridge, engine.generate(PROMPTS, **SAMPLING), 2)
    if world.rank == 0:
        (out / "remote.json").write_text(json.dumps(result))
    world.bridge.barrier().wait()
    if engine is not None:
        engine.shutdown()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
