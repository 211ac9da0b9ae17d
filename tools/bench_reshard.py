"""Benchmark the Megatron → vLLM weight sync on CPU, and the plan for a 72B model.

    python tools/bench_reshard.py                    # executor vs torch.clone, 72B plan time
    python tools/bench_reshard.py --vllm             # also into a real vLLM engine (in-process)
    python tools/bench_reshard.py --family qwen3_moe # a Mixture-of-Experts model (16 experts)

1. Sync throughput: one process, training TP = PP = 1 (no process group needed), a random model
   of ``--layers`` × ``--hidden``. The executor streams buckets into a consumer; bytes per second
   are compared with ``torch.clone`` of the same Megatron tensors in the same process. Consumers:
   ``copy`` (copies every tensor into preallocated destinations, as a loader does: two copies per
   byte in all, so about half the clone rate is the ceiling), ``none`` (only the executor's own
   copy into the bucket) and, with ``--vllm``, a real engine (vLLM's ``load_weights`` and
   re-packing included). ``--family qwen3_moe``: the same for a Qwen3-MoE model (``--experts``
   experts per layer, each ``hidden/2`` wide, top-2), whose layers' experts travel as one
   module each (vLLM's ``FusedMoE``).
2. Plan time: :func:`make_reshard_plan` for a Qwen2.5-72B-shaped model (80 layers, hidden 8192,
   ffn 29568, 64/8 heads, vocab 152064) at TP=8, PP=4 → vLLM TP=8; no tensors are allocated.
   Also the bytes one rank receives from the other stages per sync (its vLLM TP slices).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.commands.plan import PRESETS
from megarl.config.dtypes import torch_dtype
from megarl.config.model_dims import ModelDims
from megarl.models import hf_mapping as hm
from megarl.models.tiny import random_hf_state, tiny_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.rollout.reshard import make_reshard_plan, stream_buckets
from tests.rollout._sync_meters import CopySink


class NullSink:
    """Takes each bucket and does nothing with it (the ``none`` consumer)."""

    def begin_weight_update(self) -> None:
        pass

    def load_weight_chunk(self, named_tensors) -> None:
        for _ in named_tensors:
            pass

    def finish_weight_update(self) -> None:
        pass


def _interleaved(fns: dict, reps: int) -> dict[str, list[float]]:
    """Seconds per call of each function, measured round-robin (one warm-up round)."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    for rnd in range(reps + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if rnd:
                out[name].append(time.perf_counter() - start)
    return out


def _time(fn, reps: int) -> list[float]:
    fn()  # warm-up (allocator, page faults)
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def bench_sync(args) -> dict:
    dtype = torch_dtype(args.dtype)
    experts = (
        {"num_experts": args.experts, "moe_intermediate_size": args.hidden // 2}
        if args.family == "qwen3_moe"
        else {}
    )
    hf_cfg = tiny_hf_config(
        args.family,
        **experts,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=3 * args.hidden,
        vocab_size=args.vocab,
        dtype=dtype,
    )
    dims = ModelDims.from_hf_config(hf_cfg)
    hf = random_hf_state(dims, seed=0, dtype=dtype)
    params = {k: v.contiguous() for k, v in hm.hf_to_megatron(hf, dims).items()}
    plan = make_reshard_plan(
        dims, ParallelLayout(), 1, bucket_bytes=int(args.bucket_mb * (1 << 20)), dtype=dtype
    )
    nbytes = plan.hf_bytes
    results: dict = {
        "model": (
            f"{args.family}, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
            + (f"{args.experts} experts, " if experts else "")
            + args.dtype
        ),
        "bytes": nbytes,
        "buckets": len(plan.buckets),
        "bucket_mb": args.bucket_mb,
        "threads": torch.get_num_threads(),
    }

    def clone_all():
        return [p.clone() for p in params.values()]

    # A second baseline without allocation: copy_ into preallocated tensors (memory bandwidth;
    # clone also pays for fresh pages on every call).
    targets = [torch.empty_like(p) for p in params.values()]

    def copy_all():
        for t, p in zip(targets, params.values(), strict=True):
            t.copy_(p)

    # the ``copy`` consumer: the tests' fake engine, copying into preallocated destinations
    copy_sink, null_sink = CopySink(plan), NullSink()
    total = sum(p.nbytes for p in params.values())
    times = _interleaved(
        {
            "clone": clone_all,
            "copy": copy_all,
            "sync_copy": lambda: stream_buckets(params, plan, copy_sink),
            "sync_none": lambda: stream_buckets(params, plan, null_sink),
        },
        args.reps,
    )
    results["clone_GBps"] = total / min(times["clone"]) / 1e9
    results["copy_GBps"] = total / min(times["copy"]) / 1e9
    for name in ("copy", "none"):
        sync = times[f"sync_{name}"]
        results[f"sync_{name}_GBps"] = nbytes / min(sync) / 1e9
        results[f"sync_{name}_median_s"] = statistics.median(sync)
        # median of per-round ratios: robust to load changing between rounds (shared cores)
        results[f"ratio_{name}"] = statistics.median(
            (nbytes / s) / (total / c) for s, c in zip(sync, times["clone"], strict=True)
        )
        results[f"ratio_{name}_vs_copy"] = statistics.median(
            (nbytes / s) / (total / c) for s, c in zip(sync, times["copy"], strict=True)
        )
    if args.vllm:
        results.update(_bench_vllm(args, hf_cfg, hf, params, plan))
    return results


def _bench_vllm(args, hf_cfg, hf, params, plan) -> dict:
    import os

    from safetensors.torch import save_file

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from megarl.rollout.vllm_engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hf_cfg))
        save_file({k: v.contiguous() for k, v in hf.items()}, str(Path(tmp) / "model.safetensors"))
        start = time.perf_counter()
        engine = VLLMEngine(
            tmp,
            max_model_len=64,
            dtype=args.dtype,
            kv_cache_memory_bytes=16 << 20,
        )
        started = time.perf_counter() - start
        times = _time(lambda: stream_buckets(params, plan, engine), max(1, args.reps // 2))
        engine.shutdown()
    best = plan.hf_bytes / min(times) / 1e9
    return {
        "vllm_start_s": started,
        "sync_vllm_GBps": best,
        "sync_vllm_median_s": statistics.median(times),
    }


def bench_plan(reps: int) -> dict:
    dims = ModelDims.from_hf_config(PRESETS["qwen2.5-72b"], tp_size=8)
    times = _time(lambda: make_reshard_plan(dims, ParallelLayout(8, 4), 8), reps)
    plan = make_reshard_plan(dims, ParallelLayout(8, 4), 8)
    return {
        "plan_72b_ms_best": min(times) * 1e3,
        "plan_72b_ms_median": statistics.median(times) * 1e3,
        "plan_72b_buckets": len(plan.buckets),
        "plan_72b_GiB": plan.hf_bytes / (1 << 30),
        "plan_72b_peak_GiB": plan.peak_bytes / (1 << 30),
        # stage 1 of 4 (one 8-GPU node): what a rank receives from the other stages
        "plan_72b_received_GiB_per_rank": plan.received(1, 0).pipeline / (1 << 30),
        "plan_72b_unsliced_GiB_per_rank": plan.full_bytes_from_other_stages(1) / (1 << 30),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--family", choices=["qwen2", "qwen3_moe"], default="qwen2")
    ap.add_argument("--experts", type=int, default=16, help="experts per layer (qwen3_moe)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vllm", action="store_true", help="also sync into a real vLLM engine")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    results = {**bench_sync(args), **bench_plan(max(args.reps, 5))}
    if args.json:
        print(json.dumps(results))
        return 0
    mb = results["bytes"] / 1e6
    print(
        f"model: {results['model']}: {mb:.1f} MB in {results['buckets']} buckets of <= "
        f"{results['bucket_mb']} MiB, {results['threads']} torch threads"
    )
    print(
        f"torch.clone of the same tensors: {results['clone_GBps']:.2f} GB/s; copy_ into "
        f"preallocated tensors: {results['copy_GBps']:.2f} GB/s"
    )
    for name, what in (("copy", "into preallocated buffers"), ("none", "consumer does nothing")):
        print(
            f"sync ({what}): {results[f'sync_{name}_GBps']:.2f} GB/s = "
            f"{results[f'ratio_{name}']:.2f} x clone, "
            f"{results[f'ratio_{name}_vs_copy']:.2f} x copy_ (median of per-round ratios)"
        )
    if "sync_vllm_GBps" in results:
        print(
            f"sync into vLLM (reload incl.): {results['sync_vllm_GBps']:.3f} GB/s = "
            f"{results['sync_vllm_GBps'] / results['clone_GBps']:.3f} x clone "
            f"(engine start {results['vllm_start_s']:.1f} s)"
        )
    print(
        f"plan, Qwen2.5-72B TP=8 PP=4 -> vLLM TP=8: {results['plan_72b_ms_best']:.1f} ms best, "
        f"{results['plan_72b_ms_median']:.1f} ms median; {results['plan_72b_buckets']} buckets, "
        f"{results['plan_72b_GiB']:.1f} GiB, peak extra <= {results['plan_72b_peak_GiB']:.2f} GiB"
    )
    print(
        f"  a PP1 rank receives {results['plan_72b_received_GiB_per_rank']:.1f} GiB from other "
        f"stages per sync (whole buckets: {results['plan_72b_unsliced_GiB_per_rank']:.1f} GiB)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
