"""torchrun worker for tests/rollout/test_vllm_engine.py: one launch, many checks.

Run as ``torchrun --nproc_per_node 2 _vllm_worker.py --models DIR --out DIR``. Starts a gloo
default group first (as the trainer does), then builds three engines one after another in the same
processes (TP_v=1 → rollout DP 2; TP_v=2 → DP 1, built with ``VLLMEngine.from_config``; TP_v=2 on
a single-KV-head model), records every
rollout to ``OUT/rank{r}.json`` and writes perturbed checkpoints for the HF reference to ``OUT/``.
The pytest side asserts; this script only records (and fails loudly on exceptions).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from pathlib import Path

T = 0.7
MAX_TOKENS = 12
VOCAB = 1000
TEACHER_K = 8


def make_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 9))] for _ in range(count)]


def record(batch) -> list[dict]:
    return [
        {
            "prompt_index": s.prompt_index,
            "sample_index": s.sample_index,
            "prompt_id": s.prompt_id,
            "prompt": s.prompt_token_ids,
            "response": s.response_token_ids,
            "logprobs": s.response_logprobs,
            "finish_reason": s.finish_reason,
            "versions": s.token_versions,
        }
        for s in batch
    ]


class StopAfter:
    """Partial rollouts' :class:`~megarl.rollout.partial.Interrupts` for the tests: stop once,
    after ``after`` engine steps, and load ``state`` then (as the rollout ranks load an update);
    both TP ranks agree through an all-reduce, as the serving loop's do."""

    def __init__(self, engine, after: int, state: dict) -> None:
        self.engine, self.after, self.state = engine, after, state
        self.version, self.polls, self.swaps = 0, 0, 0

    def poll(self, busy: bool) -> tuple[bool, bool]:
        import torch
        import torch.distributed as dist

        self.polls += 1
        flags = torch.tensor([int(self.polls == self.after), int(busy)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def swap(self) -> None:
        from megarl.rollout.base import update_weights

        update_weights(self.engine, self.state.items())
        self.version += 1
        self.swaps += 1


class Scripted:
    """The serving loop's inbox for the tests: ``(after, command)`` in order, each taken in
    once the loop has looked ``after`` times without waiting (about once per engine step);
    waiting, the next one at once."""

    def __init__(self, script: list[tuple[int, tuple]]) -> None:
        self.script, self.looks = list(script), 0

    def get_nowait(self):
        import queue

        self.looks += 1
        if not self.script or self.script[0][0] > self.looks:
            raise queue.Empty
        return time.perf_counter(), self.script.pop(0)[1]

    def get(self):
        return time.perf_counter(), self.script.pop(0)[1]


def stream_serve(engine, prompts: list, state: dict) -> dict:
    """Partial rollouts' serving loop with continuous batching over the replicas: three
    requests, greedy; the second and third join while the first runs, an update (the same
    weights) stops them all mid-way; each reply's batch, with the reference of each request
    generated alone beforehand."""
    from collections import deque

    from megarl.rollout.base import update_weights
    from megarl.rollout.distribute import generate_on_replicas, object_group
    from megarl.rollout.remote.interrupts import ServeInterrupts
    from megarl.rollout.remote.stream import serve_stream

    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "seed": 7, "step": 0}
    requests = [
        (prompts[:3], {**greedy, "n": 2, "prompt_ids": [0, 1, 2]}, None),
        (prompts[3:], {**greedy, "n": 2, "prompt_ids": [3, 4]}, None),
        (prompts, {**greedy, "n": 1, "step": 1}, None),
    ]
    alone = [record(generate_on_replicas(engine, p, **kw)) for p, kw, _ in requests]
    inbox = Scripted([(1, ("generate", 0, requests[:1])), (3, ("generate", 0, requests[1:])),
                      (6, ("weights", 1, None)), (7, ("stop",))])  # fmt: skip
    pending: deque = deque()
    interrupts = ServeInterrupts(
        inbox, pending, lambda _: update_weights(engine, state.items()), 0, object_group(None)
    )
    replies: list = []
    serve_stream(engine, interrupts, inbox, replies.append, None)
    return {
        "stream_alone": alone,
        "stream_replies": [record(r["batch"]) for r in replies],
        "stream_interruptions": [r["timing"]["interruptions"] for r in replies],
    }


def noisy_state(model_dir: Path, seed: int) -> dict:
    import torch
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    state = load_file(str(model_dir / "model.safetensors"))
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sorted(state.items())}


def save_checkpoint(src: Path, dst: Path, state: dict) -> None:
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))


def seed_global_rngs(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def draw_global_rngs() -> list[float]:
    import numpy as np
    import torch

    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    dist.init_process_group("gloo")  # the trainer's group exists before the engine
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    dist.new_group([0, 1])  # groups made before the engine (as Megatron's) must not confuse it

    from megarl.config.schema import RolloutConfig
    from megarl.rollout.base import update_weights
    from megarl.rollout.distribute import generate_distributed
    from megarl.rollout.vllm_engine import VLLMEngine

    out: dict = {"rank": rank, "timings": {}, "records": {}, "meta": {}}
    rec, tim = out["records"], out["timings"]
    prompts = make_prompts(5)
    shards = {0: prompts[:3], 1: prompts[3:]}  # uneven training-DP shards
    out["meta"].update(prompts=prompts, local=shards[rank], temperature=T, max_tokens=MAX_TOKENS)
    sampling = {"n": 3, "temperature": T, "max_tokens": MAX_TOKENS, "seed": 7, "step": 0}
    tiny, tiny_kv1 = args.models / "tiny", args.models / "tiny_kv1"

    def make(path: Path, tp: int, tag: str) -> VLLMEngine:
        t = time.perf_counter()
        engine = VLLMEngine(
            path,
            tensor_parallel_size=tp,
            seed=0,
            max_model_len=128,
            dtype="float32",
            kv_cache_memory_bytes=32 << 20,
            max_num_seqs=64,
        )
        tim[f"{tag}_start_s"] = time.perf_counter() - t
        out["meta"].setdefault("update_in_place", {})[tag] = engine._update_in_place
        return engine

    def make_from_config(path: Path, tag: str) -> VLLMEngine:
        """The trainer's way: the config section; non-default scheduler settings that must
        reach vLLM (chunked prefill off, a token budget), recorded from vLLM's own config."""
        t = time.perf_counter()
        rollout = RolloutConfig(
            tensor_model_parallel_size=2,
            prompt_length=64,
            response_length=64,
            max_num_seqs=64,
            max_num_batched_tokens=256,
            enable_chunked_prefill=False,
            enforce_eager=True,
            kv_cache_memory_bytes=32 << 20,
        )
        # trust_remote_code as the trainer passes it (actor_rollout_ref.model.trust_remote_code)
        engine = VLLMEngine.from_config(rollout, path, dtype="fp32", seed=0, trust_remote_code=True)
        tim[f"{tag}_start_s"] = time.perf_counter() - t
        cfg = engine._llm.llm_engine.vllm_config
        out["meta"]["from_config"] = {
            "max_model_len": cfg.model_config.max_model_len,
            "dtype": str(cfg.model_config.dtype),
            "logprobs_mode": cfg.model_config.logprobs_mode,
            "enable_chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "enforce_eager": cfg.model_config.enforce_eager,
            "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
            "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
            "load_format": str(cfg.load_config.load_format),
            "trust_remote_code": cfg.model_config.trust_remote_code,
        }
        return engine

    def timed(tag: str, fn):
        t = time.perf_counter()
        result = fn()
        tim[f"{tag}_s"] = time.perf_counter() - t
        return result

    tim["import_and_init_s"] = time.perf_counter() - t0

    # ---- A: TP_v=1, rollout DP 2 ----------------------------------------------------------
    def run(**overrides):
        """This rank's training-DP shard through whichever engine is current."""
        kw = {**sampling, **overrides}
        return generate_distributed(engine, shards[rank], dp_rank=rank, dp_size=2, **kw)

    seed_global_rngs(1000 + rank)  # the engine must not move the trainer's random streams
    engine = make(tiny, 1, "tp1")
    out["meta"]["eos"] = engine.eos_token_ids
    one = torch.ones(1)  # training-side groups made after the engine still work
    dist.all_reduce(one, group=dist.new_group([0, 1]))
    assert one.item() == world
    rec["tp1"] = record(timed("tp1_first_generate", run))
    rec["tp1_repeat"] = record(run())
    rec["tp1_other_seed"] = record(run(seed=8))
    rec["tp1_other_step"] = record(run(step=1))
    # Partial rollouts over two replicas with shares of their own (one finishes first and keeps
    # answering the other's polls): greedy, interrupted once, the same weights reloaded.
    from safetensors.torch import load_file

    rec["tp1_greedy"] = record(run(temperature=0.0))
    same = load_file(str(tiny / "model.safetensors"))
    rec["tp1_greedy_partial"] = record(run(temperature=0.0, interrupts=StopAfter(engine, 4, same)))
    rec.update(stream_serve(engine, prompts, same))
    # training DP 1: both ranks hold the full list (like TP peers); many extra stop ids.
    stops = list(range(4, 300))
    out["meta"]["extra_stops"] = stops
    rec["tp1_dp1_stops"] = record(
        generate_distributed(
            engine,
            prompts,
            dp_rank=0,
            dp_size=1,
            **{**sampling, "n": 2, "max_tokens": 16, "stop_token_ids": stops},
        )
    )
    assert len(engine.generate([], n=2, temperature=T, max_tokens=4, seed=0)) == 0
    # Throughput: 16 prompts x 4 samples x 32 tokens on this rank's engine alone.
    big = make_prompts(16, seed=1)
    for tag in ("warm", "steady"):
        t = time.perf_counter()
        b = engine.generate(big, n=4, temperature=1.0, max_tokens=32, seed=1)
        dt = time.perf_counter() - t
        tim[f"tp1_{tag}_samples"] = len(b)
        tim[f"tp1_{tag}_tokens"] = sum(len(s.response_token_ids) for s in b)
        tim[f"tp1_{tag}_tok_per_s"] = tim[f"tp1_{tag}_tokens"] / dt
    out["rng_after_tp1"] = draw_global_rngs()
    engine.shutdown()
    dist.barrier()

    # ---- B: TP_v=2, rollout DP 1, built from the config; weight updates ---------------------
    # The trainer's way reads no checkpoint: it starts from a copy of the model directory
    # without its weights file; the first sync (as the trainer's first_sync) brings them.
    bare = args.out / "tiny_without_weights"
    if rank == 0:
        bare.mkdir()
        for item in tiny.iterdir():
            if item.suffix != ".safetensors":
                shutil.copy(item, bare / item.name)
    dist.barrier()
    engine = make_from_config(bare, "tp2")

    timed(
        "tp2_first_sync",
        lambda: update_weights(engine, load_file(str(tiny / "model.safetensors")).items()),
    )
    from megarl.rollout.vllm_process import cpu_shared_memory

    out["meta"]["shm"] = [(str(path), path.exists()) for path in cpu_shared_memory()]
    out["meta"]["master_port"] = os.environ["MASTER_PORT"]
    # vLLM's CPU collectives use shared memory only where its kernel build has the manager (its
    # AVX2 build has none: they fall back to torch.distributed); the same test vLLM makes.
    out["meta"]["shm_manager"] = hasattr(torch.ops._C, "init_shm_manager")
    rec["tp2"] = record(run())
    # A teacher's scores (issue 57): fixed sequences, the same on both TP ranks, scored with
    # vLLM's prompt log-probs (the top-TEACHER_K and the token there at every response position).
    from megarl.rollout.teacher_scores import prompt_topk_log_probs

    teacher_prompts, teacher_responses = make_prompts(4, seed=3), make_prompts(4, seed=4)
    scores = prompt_topk_log_probs(
        engine, [p + r for p, r in zip(teacher_prompts, teacher_responses, strict=True)],
        [len(p) for p in teacher_prompts], TEACHER_K,
    )  # fmt: skip
    out["teacher"] = {
        "prompts": teacher_prompts,
        "responses": teacher_responses,
        "topk_ids": scores.topk_ids.tolist(),
        "topk_log_probs": scores.topk_log_probs.tolist(),
        "log_probs": scores.log_probs.tolist(),
    }
    noisy = noisy_state(tiny, seed=123)
    if rank == 0:
        save_checkpoint(tiny, args.out / "tiny_noisy", noisy)
    # Partial rollouts: interrupted after 4 engine steps (the prefill and 3 tokens) and
    # continued, greedy on the same weights reloaded, then sampled onto the noisy ones.
    same = load_file(str(tiny / "model.safetensors"))
    rec["tp2_greedy"] = record(run(temperature=0.0))
    rec["tp2_greedy_partial"] = record(run(temperature=0.0, interrupts=StopAfter(engine, 4, same)))
    stop = StopAfter(engine, 4, noisy)
    rec["tp2_partial_noisy"] = record(run(interrupts=stop))
    out["meta"]["partial_swaps"] = stop.swaps
    # One session, one chunk given as a lazy generator.
    timed("tp2_update_weights", lambda: update_weights(engine, ((k, v) for k, v in noisy.items())))
    rec["tp2_noisy"] = record(run())
    # Zero lm_head only (a partial update).
    update_weights(engine, [("lm_head.weight", torch.zeros_like(noisy["lm_head.weight"]))])
    rec["tp2_zero_lm_head"] = record(run(n=1))
    # Back to the original weights, one tensor per chunk in shuffled order (modules split
    # across chunks), then the very first call again.
    original = sorted(load_file(str(tiny / "model.safetensors")).items())
    random.Random(0).shuffle(original)
    engine.begin_weight_update()
    for name, tensor in original:
        engine.load_weight_chunk([(name, tensor)])
    engine.finish_weight_update()
    rec["tp2_restored"] = record(run())
    engine.shutdown()
    dist.barrier()

    # ---- C: TP_v=2 on a single KV head (vLLM replicates it) --------------------------------
    engine = make(tiny_kv1, 2, "kv1")
    rec["kv1"] = record(run())
    noisy = noisy_state(tiny_kv1, seed=321)
    if rank == 0:
        save_checkpoint(tiny_kv1, args.out / "tiny_kv1_noisy", noisy)
    update_weights(engine, noisy.items())
    rec["kv1_noisy"] = record(run())
    engine.shutdown()

    tim["total_s"] = time.perf_counter() - t0
    (args.out / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
