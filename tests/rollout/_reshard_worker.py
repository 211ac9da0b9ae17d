"""torchrun worker for tests/rollout/test_reshard_sync.py: one launch per suite, many cases.

    torchrun --nproc_per_node W _reshard_worker.py --suite layouts|vllm|gpu --models DIR --out DIR

Suites:

- ``layouts`` (no vLLM): for several models and Megatron layouts, sync into a fake engine that
  copies into preallocated tensors, under :class:`LiveBytes`; records whether the plan's
  ownership agrees with Megatron's ``layer_offset``, the largest difference from the reference HF
  state (HF checkpoint + the same seeded noise, converted with ``hf_mapping``), and the peak of
  live bytes allocated during the sync against the plan's bound; then the same sliced for vLLM
  TP 2 (:func:`sliced_sync_check`: unreceived elements NaN, vLLM's narrowing, bytes received).
- ``vllm``: one real vLLM engine per (model, rollout TP); per Megatron layout: perturb the actor,
  generate (engine still holds the previous weights), sync (unreceived elements NaN, bytes
  metered), generate the same prompts/seeds again, and compare both rollouts' log-probs with
  the actor's runner.
- ``gpu``: bf16 with sleep/wake and vLLM parameter addresses (only meaningful with CUDA).
- ``gpu_ep``: vLLM expert parallelism on two GPUs (vLLM's CPU MoE kernel cannot run it).

The engine-protocol conformance probe (``_engine_conformance.py``) runs on an ``ActorEngine`` in
``layouts`` (Megatron DP 2 and PP 2) and on the vLLM TP 1 engine in ``vllm`` (rollout DP 2).

Every rank writes ``OUT/{suite}_rank{r}.json``; the pytest side asserts.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import time
from pathlib import Path

import torch

from tests.rollout._sync_meters import CopySink, LiveBytes, WireMeter

T = 0.7
NOISE = 0.02
PROMPTS = [[11, 42, 7, 99, 500], [3, 14, 15, 92, 65, 35, 89], [271, 828, 182, 845]]
SAMPLING = {"n": 2, "temperature": T, "max_tokens": 8, "seed": 11}


def vllm_narrow(name: str, full: torch.Tensor, dims, tp: int, rank: int) -> torch.Tensor:
    """What vLLM 0.32's weight loader on TP rank ``rank`` of ``tp`` copies out of the full HF
    tensor ``full``, written from vLLM's loaders (``QKVParallelLinear``,
    ``MergedColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``), not from
    the plan's ``rollout_slice``."""
    leaf = name.split(".")[-2]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        org = full.shape[0]
        per = ((org + 63) // 64 * 64) // tp  # pad_vocab_size, then vocab_range_from_global
        start, end = min(rank * per, org), min((rank + 1) * per, org)
        return full.narrow(0, start, end - start)
    if leaf == "q_proj":
        size = dims.num_attention_heads // tp * dims.head_dim
        return full.narrow(0, rank * size, size)
    if leaf in ("k_proj", "v_proj"):
        total = dims.num_query_groups
        replicas = tp // total if tp >= total else 1
        size = max(1, total // tp) * dims.head_dim
        return full.narrow(0, rank // replicas * size, size)
    # MergedColumnParallelLinear; FusedMoE._load_w13 (experts' gate/up, Mixtral's w1/w3: each
    # expert's intermediate rows split over TP)
    if leaf in ("gate_proj", "up_proj", "w1", "w3"):
        size = full.shape[0] // tp
        return full.narrow(0, rank * size, size)
    # RowParallelLinear; FusedMoE._load_w2 (experts' down / w2: input columns)
    if leaf in ("o_proj", "down_proj", "w2"):
        size = full.shape[1] // tp
        return full.narrow(1, rank * size, size)
    return full


def full_noise(name: str, dims, seed: int, scale: float = NOISE) -> torch.Tensor:
    """Seeded noise on the full Megatron shape of ``name``, independent of the layout.

    Vocab rows past ``vocab_size`` get none (their count depends on TP); a tied output-layer
    copy gets the embedding's noise (Megatron keeps the two equal).
    """
    from megarl.models import hf_mapping as hm

    key = hm.EMBEDDING if name == hm.OUTPUT_LAYER and dims.tie_word_embeddings else name
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    shape = hm.megatron_param_shape(name, dims)
    if hm.tp_partition_kind(name) == "vocab":
        noise = torch.randn((dims.vocab_size, *shape[1:]), generator=gen)
        noise = torch.cat([noise, noise.new_zeros(shape[0] - dims.vocab_size, *shape[1:])])
    else:
        noise = torch.randn(shape, generator=gen)
    return noise * scale


@torch.no_grad()
def perturb(chunks, dims, seed: int, scale: float = NOISE) -> None:
    """Add ``full_noise`` to every parameter (this rank's TP shard of it)."""
    from megarl.models import hf_mapping as hm
    from megarl.models.weights import local_global_names, tp_group_of

    for _, _, name, p in local_global_names(chunks):
        tp, rank = tp_group_of(name)  # expert TP for experts
        noise = hm.tp_split(name, full_noise(name, dims, seed, scale), tp, rank, dims)
        p.add_(noise.to(p.device, p.dtype))


def reference_hf(path: str, dims, seed: int) -> dict[str, torch.Tensor]:
    """HF state of the checkpoint plus ``full_noise``, converted by ``hf_mapping`` (no dist)."""
    from megarl.models import hf_mapping as hm
    from megarl.models.weights import HFCheckpointReader

    with HFCheckpointReader(path) as reader:
        full = {
            n: hm.hf_to_megatron_param(n, reader.get, dims) + full_noise(n, dims, seed)
            for n in hm.megatron_param_names(dims)
        }
    return hm.megatron_to_hf(full, dims)


def build(
    path: str,
    tp: int,
    pp: int,
    vpp: int | None,
    ep: int = 1,
    etp: int | None = None,
    *,
    dtype=torch.float32,
    split: dict | None = None,
):
    """Megatron's groups for (TP, PP, VPP, EP, ETP) and the model from ``path`` (``split``:
    Megatron's uneven layer split fields)."""
    from megarl.models.build import build_model
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout(
        tp, pp, vpp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, **(split or {})
    )
    init_distributed(layout, seed=1234)
    built = build_model(path, layout, dtype=dtype)
    for chunk in built.chunks:  # nothing trains here; Megatron's MoE layer refuses a
        chunk.eval()  # training-mode forward at TP > 1 without sequence parallelism
    return built.dims, built.chunks


def ownership_agrees(chunks, plan) -> bool:
    """Megatron's own layer offsets == the plan's split (even or uneven), chunk by chunk."""
    from megatron.core import parallel_state

    from megarl.models.gpt import layer_offset, unwrap
    from megarl.rollout.reshard.plan import chunk_layer_range

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ok = True
    for i, chunk in enumerate(chunks):
        model = unwrap(chunk)
        want = chunk_layer_range(plan.dims, plan.layout, pp_rank, i)
        ok &= layer_offset(model.config, model.vp_stage) == want.start
        ok &= len(model.decoder.layers) == len(want)
    return bool(ok)


def fake_sync_check(path: str, dims, chunks, seed: int, bucket_bytes: int) -> dict:
    """Sync into a CopySink under LiveBytes; compare with the reference HF state."""
    from megarl.rollout.reshard import plan_for_chunks, sync_weights

    plan = plan_for_chunks(chunks, dims, rollout_tp=1, bucket_bytes=bucket_bytes)
    sink = CopySink(plan)
    gc.collect()
    with LiveBytes(bound=plan.peak_bytes) as meter:
        stats = sync_weights(chunks, plan, sink)
        gc.collect()
        # gloo's worker thread may still hold the last broadcast buffer until it gets the GIL
        leftover = meter.wait_released(timeout_s=10.0)
    ref = reference_hf(path, dims, seed)
    diff = max((sink.dest[k] - v).abs().max().item() for k, v in ref.items() if k in sink.dest)
    return {
        "ownership_agrees": ownership_agrees(chunks, plan),
        "names_equal": sorted(sink.dest) == sorted(ref),
        "max_diff": diff,
        "peak": meter.peak,
        "leftover": leftover,
        "bound": plan.peak_bytes,
        "largest_bucket": max(b.nbytes for b in plan.buckets),
        "model_bytes": plan.total_bytes,
        "buckets": len(plan.buckets),
        "calls": sink.calls,
        "planned_calls": ["begin", *[len(b.slots) for b in plan.buckets], "finish"],
        "stats_bytes": stats.bytes,
    }


def _traffic(plan, stats, wire: WireMeter) -> dict:
    """Bytes received on this rank: the plan's, the executor's count, the wire meter's."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl.rollout.reshard.executor import rollout_rank_of

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank() if plan.layout.ep > 1 else 0
    v = rollout_rank_of(dist.get_rank(), plan.rollout_tp)
    planned = plan.received(pp_rank, v, ep_rank)
    other = sum(s.numel for b in plan.buckets if b.pp_rank != pp_rank for s in b.slots)
    return {
        "pp_rank": pp_rank,
        "rollout_rank": v,
        "rollout_tp": plan.rollout_tp,
        "planned": {
            "pipeline": planned.pipeline,
            "tp": planned.tp_gather,
            "ep": planned.ep_broadcast,
        },
        "stats": {
            "pipeline": stats.pipeline_received_bytes,
            "tp": stats.tp_received_bytes,
            "ep": stats.ep_received_bytes,
        },
        "wire": {"pipeline": wire.pipeline, "tp": wire.tp, "ep": wire.ep},
        "unsliced": plan.full_bytes_from_other_stages(pp_rank),
        "other_stages_hf_bytes": other * plan.itemsize if plan.layout.pp > 1 else 0,
        "model_hf_bytes": plan.hf_bytes,
        "slice_bytes": plan.rollout_slice_bytes(v),
    }


def sliced_sync_check(path: str, dims, chunks, seed: int, bucket_bytes: int, rollout_tp: int):
    """Sync for vLLM TP ``rollout_tp`` into a CopySink, elements not received set to NaN: what
    vLLM's loader of this rank would copy (``vllm_narrow``) equals the reference, with no NaN;
    nothing else from other stages was received; bytes received: plan = executor = wire."""
    import torch.distributed as dist

    from megarl.rollout.reshard import plan_for_chunks, sync_weights
    from megarl.rollout.reshard.executor import rollout_rank_of

    plan = plan_for_chunks(chunks, dims, rollout_tp=rollout_tp, bucket_bytes=bucket_bytes)
    v = rollout_rank_of(dist.get_rank(), rollout_tp)
    sink = CopySink(plan)
    gc.collect()
    with LiveBytes(bound=plan.peak_bytes) as meter, WireMeter() as wire:
        stats = sync_weights(chunks, plan, sink, fill_unsent=float("nan"))
        gc.collect()
        leftover = meter.wait_released(timeout_s=10.0)
    ref = reference_hf(path, dims, seed)
    diff = 0.0
    for k, want in ref.items():
        got = vllm_narrow(k, sink.dest[k], dims, rollout_tp, v)
        err = (got - vllm_narrow(k, want, dims, rollout_tp, v)).abs()
        diff = max(diff, torch.nan_to_num(err, nan=float("inf")).max().item() if err.numel() else 0)
    traffic = _traffic(plan, stats, wire)
    other = [s for b in plan.buckets if b.pp_rank != traffic["pp_rank"] for s in b.slots]
    return {
        "narrowed_max_diff": diff,
        "received_elements": sum(int((~sink.dest[s.name].isnan()).sum()) for s in other),
        "planned_elements": sum(
            b.message_numel(v) for b in plan.buckets if b.pp_rank != traffic["pp_rank"]
        ),
        "peak": meter.peak,
        "bound": plan.peak_bytes,
        "leftover": leftover,
        **traffic,
    }


# --------------------------------------------------------------------------------------------
# Suites
# --------------------------------------------------------------------------------------------


ACTOR_CONFORMANCE_CASES = ("tiny_tp1_pp1_vpp1", "tiny_tp1_pp2_vpp1")  # DP 2; PP 2


def _train_dp() -> tuple[int, int]:
    from megatron.core import parallel_state

    return (
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )


def actor_conformance(path: str, dims, chunks, seed: int) -> dict:
    """The engine protocol's conformance probe on an ActorEngine over ``chunks``."""
    from megarl.rollout.actor_engine import ActorEngine
    from megarl.rollout.vllm_engine import read_eos_token_ids
    from tests.rollout._engine_conformance import probe_engine

    engine = ActorEngine(chunks, vocab_size=dims.vocab_size, eos_token_ids=read_eos_token_ids(path))
    return probe_engine(
        engine,
        chunks,
        dims,
        perturb_actor=functools.partial(perturb, chunks, dims, seed + 1000),
        train_dp=_train_dp(),
    )


def case_key(model: str, layout: tuple, rollout_tp: int | None = None) -> str:
    """``{model}[_vtp{v}]_tp{t}_pp{p}_vpp{vp}[_ep{e}_etp{et}]`` for a layout (TP, PP, VPP[, EP,
    ETP]); the EP part only with expert parallelism."""
    tp, pp, vpp, ep, etp = (*layout, 1, None)[:5]
    vtp = f"_vtp{rollout_tp}" if rollout_tp else ""
    experts = f"_ep{ep}_etp{etp or tp}" if ep > 1 else ""
    return f"{model}{vtp}_tp{tp}_pp{pp}_vpp{vpp or 1}{experts}"


def layouts_suite(models: Path) -> dict:
    cases = [
        ("tiny", (1, 1, None)),
        ("tiny", (2, 1, None)),
        ("tiny", (1, 2, None)),
        ("tiny", (1, 2, 2)),
        ("special", (1, 2, None)),  # tied embeddings (copy on the last stage), qk-norm, 1 KV head
        ("qwen3", (2, 1, None)),
        ("moe", (1, 1, None, 2, None)),  # Qwen3-MoE, EP 2 (expert broadcast), DP 2
        ("moe", (1, 2, None)),  # experts sliced across stages for vLLM TP 2
        ("mixtral", (2, 1, None, 2, 1)),  # TP 2 (dense gather), EP 2, expert TP 1
        # Megatron's uneven split: 3 layers on stage 0, 1 on stage 1 (key ``..._last1``)
        ("special", (1, 2, None), {"num_layers_in_last_pipeline_stage": 1}),
    ]
    out = {}
    for seed, (model, layout, *split) in enumerate(cases, start=1):
        path = str(models / model)
        dims, chunks = build(path, *layout, split=split[0] if split else None)
        perturb(chunks, dims, seed)
        key = case_key(model, layout) + ("_last1" if split else "")
        if split:
            from megarl.models.gpt import unwrap

            out[f"{key}/layers"] = [len(unwrap(chunk).decoder.layers) for chunk in chunks]
        out[key] = {
            "small": fake_sync_check(path, dims, chunks, seed, 64 << 10),
            "large": fake_sync_check(path, dims, chunks, seed, 512 << 10),
            "sliced": sliced_sync_check(path, dims, chunks, seed, 64 << 10, rollout_tp=2),
        }
        if key in ACTOR_CONFORMANCE_CASES:
            out[key]["conformance"] = actor_conformance(path, dims, chunks, seed)
        del chunks
        gc.collect()
    return out


def _record(batch) -> list[dict]:
    return [{"response": s.response_token_ids, "logprobs": s.response_logprobs} for s in batch]


def vllm_suite(models: Path, world: int) -> dict:
    from megarl.rollout.consistency import rollout_logprob_consistency
    from megarl.rollout.reshard import plan_for_chunks, sync_weights
    from megarl.rollout.vllm_engine import VLLMEngine

    if world == 2:
        engines = [
            ("tiny", 1, [(2, 1, None), (1, 2, None), (1, 1, None)]),
            ("tiny", 2, [(2, 1, None), (1, 2, None), (1, 2, 2), (1, 1, None)]),
            ("special", 2, [(1, 2, None)]),
            # Qwen3-MoE: EP 2 (DP 2); TP 2 with EP 2 and expert TP 1; experts across PP 2
            ("moe", 2, [(1, 1, None, 2, None), (2, 1, None, 2, 1), (1, 2, None)]),
        ]
    else:
        engines = [
            ("tiny", 2, [(2, 2, None), (2, 1, None)]),
            ("mixtral", 2, [(1, 2, None, 2, None)]),  # PP 2 × EP 2 (DP 2)
        ]
    out: dict = {"cases": {}, "timings": {}}
    seed = 100
    for model, rollout_tp, layouts in engines:
        path = str(models / model)
        # Megatron's groups exist before the engine (as in the trainer).
        dims, chunks = build(path, *layouts[0])
        t = time.perf_counter()
        engine = VLLMEngine(
            path,
            tensor_parallel_size=rollout_tp,
            seed=0,
            max_model_len=64,
            dtype="float32",
            kv_cache_memory_bytes=16 << 20,
            max_num_seqs=16,
        )
        out["timings"][f"{model}_vtp{rollout_tp}_start_s"] = time.perf_counter() - t
        for i, layout in enumerate(layouts):
            if i:
                del chunks
                gc.collect()
                dims, chunks = build(path, *layout)
            seed += 1
            perturb(chunks, dims, seed)
            key = case_key(model, layout, rollout_tp)
            case = {"fake": fake_sync_check(path, dims, chunks, seed, 128 << 10)}
            before = engine.generate(PROMPTS, **SAMPLING)
            case["before"] = rollout_logprob_consistency(
                chunks, before, vocab_size=dims.vocab_size, temperature=T
            )
            plan = plan_for_chunks(chunks, dims, rollout_tp, bucket_bytes=256 << 10)
            # what this rank did not receive is NaN: vLLM must never read it
            with WireMeter() as wire:
                stats = sync_weights(chunks, plan, engine, fill_unsent=float("nan"))
            after = engine.generate(PROMPTS, **SAMPLING)
            case["after"] = rollout_logprob_consistency(
                chunks, after, vocab_size=dims.vocab_size, temperature=T
            )
            case.update(
                before_samples=_record(before),
                after_samples=_record(after),
                buckets=stats.buckets,
                planned_buckets=len(plan.buckets),
                sync_s=stats.seconds,
                sync_bytes=stats.bytes,
                planned_bytes=sum(b.nbytes for b in plan.buckets),
                traffic=_traffic(plan, stats, wire),
            )
            out["cases"][key] = case
        if model == "moe":  # lora.merge=true on the MoE actor: merged expert weights
            t = time.perf_counter()
            out["lora_moe"] = moe_lora_merged_case(path, engine)  # (not a plan-traffic case)
            out["timings"]["lora_moe_s"] = time.perf_counter() - t
        if rollout_tp == 1:  # rollout DP 2 at 2 ranks; the engine holds the actor's weights
            from tests.rollout._engine_conformance import probe_engine

            out["conformance"] = probe_engine(
                engine,
                chunks,
                dims,
                perturb_actor=functools.partial(perturb, chunks, dims, seed + 1000),
                train_dp=_train_dp(),
            )
        engine.shutdown()
        del chunks
        gc.collect()
    if world == 2:
        t = time.perf_counter()
        out["lora"] = lora_adapter_cases(models)
        out["timings"]["lora_s"] = time.perf_counter() - t
    return out


def lora_adapter_cases(models: Path) -> dict:
    """``lora.merge=false`` at 2 ranks, vLLM TP 2 with its LoRA layers (base read from disk):
    Megatron PP 2 with random non-zero adapters (the sync sends the adapters alone, each stage's
    gathered over PP), then TP 2 with other adapters and a perturbed base after ``sleep(2)``
    (the sync sends the base, then the adapters). vLLM's log-probs vs the actor's after each."""
    from megarl.models.lora import LoraSettings, attach_adapters
    from megarl.models.lora_peft import every_stage_adapters
    from megarl.rollout.consistency import rollout_logprob_consistency
    from megarl.rollout.reshard import plan_for_chunks, sync_weights
    from megarl.rollout.vllm_engine import VLLMEngine

    path, out = str(models / "tiny"), {}
    dims, chunks = build(path, 1, 2, None)
    engine = VLLMEngine(path, tensor_parallel_size=2, seed=0, max_model_len=64, dtype="float32",
                        kv_cache_memory_bytes=16 << 20, max_num_seqs=16, lora_rank=4)  # fmt: skip
    for i, layout in enumerate([(1, 2, None), (2, 1, None)]):
        if i:
            del chunks
            gc.collect()
            dims, chunks = build(path, *layout)
            perturb(chunks, dims, 300)
            engine.sleep(level=2)  # vLLM's base is stale: the next sync sends it again
        attach_adapters(chunks, LoraSettings(rank=4, alpha=0.8, b_init="normal", seed=i))
        before = engine.generate(PROMPTS, **SAMPLING) if not i else None
        plan = plan_for_chunks(chunks, dims, 2, bucket_bytes=256 << 10)
        stats = sync_weights(chunks, plan, engine)
        after = engine.generate(PROMPTS, **SAMPLING)
        state, _ = every_stage_adapters(chunks, dims)
        out[case_key("lora", layout, 2)] = {
            "before": before and rollout_logprob_consistency(
                chunks, before, vocab_size=dims.vocab_size, temperature=T),
            "after": rollout_logprob_consistency(
                chunks, after, vocab_size=dims.vocab_size, temperature=T),
            "sync_bytes": stats.bytes,
            "adapter_bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "model_bytes": sum(b.nbytes for b in plan.buckets),
        }  # fmt: skip
    engine.shutdown()
    return out


def moe_lora_merged_case(path: str, engine) -> dict:
    """``lora.merge=true`` on Qwen3-MoE at EP 2: random non-zero adapters on attention and every
    expert's fc1/fc2 over a perturbed base; the sync sends ``W + scaling·B·A`` (each EP rank its
    experts', through the plan's EP broadcast); vLLM's log-probs vs the actor's (adapters on)."""
    from megarl.models.lora import LoraSettings, adapters_disabled, attach_adapters
    from megarl.rollout.consistency import rollout_logprob_consistency
    from megarl.rollout.reshard import plan_for_chunks, sync_weights

    dims, chunks = build(path, 1, 1, None, 2)
    perturb(chunks, dims, 400)
    n = attach_adapters(chunks, LoraSettings(rank=4, alpha=0.8, b_init="normal", seed=3))
    plan = plan_for_chunks(chunks, dims, 2, bucket_bytes=256 << 10)
    stats = sync_weights(chunks, plan, engine)
    after = engine.generate(PROMPTS, **SAMPLING)
    case = {
        "adapted_here": n,
        "after": rollout_logprob_consistency(chunks, after, vocab_size=dims.vocab_size,
                                             temperature=T),
        "sync_bytes": stats.bytes,
        "planned_bytes": sum(b.nbytes for b in plan.buckets),
    }  # fmt: skip
    with adapters_disabled(chunks):  # the base alone is far from what vLLM now holds
        case["adapters_off"] = rollout_logprob_consistency(
            chunks, after, vocab_size=dims.vocab_size, temperature=T
        )
    return case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=["layouts", "vllm", "gpu", "gpu_ep"], required=True)
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch.distributed as dist

    from megarl.parallel.init import destroy_distributed, read_launch_env

    t0 = time.perf_counter()
    world = read_launch_env().world_size
    if args.suite == "layouts":
        result = layouts_suite(args.models)
    elif args.suite == "vllm":
        result = vllm_suite(args.models, world)
    else:  # the CUDA suites (tests/rollout/_reshard_gpu_cases.py)
        from tests.rollout import _reshard_gpu_cases as gpu

        result = (gpu.gpu_ep_suite if args.suite == "gpu_ep" else gpu.gpu_suite)(args.models)
    rank = dist.get_rank()
    result = {"rank": rank, "world": world, "total_s": time.perf_counter() - t0, **result}
    (args.out / f"{args.suite}_ws{world}_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
