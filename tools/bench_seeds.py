"""What per-request seeds cost vLLM's sampler, against one seed per batch (issue 45, item 7).

    python tools/bench_seeds.py                 # the demo's batch (64) and 512 sequences

megarl seeds every response (``megarl.rollout.base.request_seed``: layout-independent, exact on
resume). vLLM 0.32 then samples those rows one by one in Python on every decode step: on GPU
(``forward_native``) one ``exponential_`` per seeded row, and FlashInfer's top-k/top-p sampler
is skipped; on CPU (``forward_cpu``) one ``torch.randint(generator=...)`` per seeded row before
its fused Gumbel kernel. Two measurements, one process, the tiny CPU model:

1. ``engine``: ``VLLMEngine.generate`` as the trainer calls it (every request seeded) against
   the same requests unseeded (vLLM's batch stream), ``ignore_eos`` so both make exactly
   ``n × max_tokens`` tokens; best of ``--reps``.
2. ``sampler``: the GPU path's noise alone on this CPU: one ``exponential_`` per row with its
   own generator against one ``exponential_`` over the batch, at the tiny vocabulary and at
   Qwen2.5's (152064).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bench_engine(batches: list[int], max_tokens: int, reps: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from megarl.models.tiny import make_tiny_model
    from megarl.rollout.base import request_seed
    from megarl.rollout.vllm_engine import VLLMEngine

    model = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "qwen2", seed=0)
    engine = VLLMEngine(model, seed=0, dtype="float32", max_model_len=128,
                        kv_cache_memory_bytes=256 << 20, max_num_seqs=512,
                        max_num_batched_tokens=8192)  # fmt: skip
    llm, out = engine._llm, {}
    for batch in batches:
        prompts = [[(7 * i + j) % 900 + 10 for j in range(8)] for i in range(batch)]
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]

        def run(seeded: bool, prompts=prompts, requests=requests) -> float:
            params = [
                SamplingParams(
                    n=1,
                    temperature=1.0,
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    seed=request_seed(0, 0, i, 0) if seeded else None,
                    logprobs=0,
                    flat_logprobs=True,
                    detokenize=False,
                )
                for i in range(len(prompts))
            ]
            start = time.perf_counter()
            llm.generate(requests, params, use_tqdm=False)
            return time.perf_counter() - start

        times = {"seeded": [], "batch_seed": []}
        for _ in range(reps):  # interleaved, first round warms up
            for key, seconds in times.items():
                seconds.append(run(key == "seeded"))
        best = {k: min(v[1:] or v) for k, v in times.items()}
        tokens = batch * max_tokens
        out[str(batch)] = {
            "tokens": tokens,
            "seeded_s": best["seeded"],
            "batch_seed_s": best["batch_seed"],
            "seeded_tok_per_s": tokens / best["seeded"],
            "batch_seed_tok_per_s": tokens / best["batch_seed"],
            "seeded_cost": best["seeded"] / best["batch_seed"] - 1,
        }
    engine.shutdown()
    return out


def bench_sampler(batches: list[int], vocabs: list[int], reps: int) -> dict:
    out = {}
    for vocab in vocabs:
        for batch in batches:
            q = torch.empty(batch, vocab)
            gens = [torch.Generator().manual_seed(i) for i in range(batch)]

            def per_row(q=q, gens=gens) -> None:
                for i, g in enumerate(gens):
                    q[i].exponential_(generator=g)

            def whole(q=q) -> None:
                q.exponential_()

            best = {}
            for name, fn in (("per_row", per_row), ("batch", whole)):
                fn()
                best[name] = min(_timed(fn) for _ in range(reps))
            out[f"{batch}x{vocab}"] = {"per_row_ms": best["per_row"] * 1e3,
                                       "batch_ms": best["batch"] * 1e3}  # fmt: skip
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64,512", help="sequences per generate (demo: 64)")
    ap.add_argument("--max-tokens", type=int, default=16, help="the demo's response length")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    batches = [int(b) for b in args.batches.split(",")]
    result = {
        "threads": torch.get_num_threads(),
        "engine": bench_engine(batches, args.max_tokens, args.reps),
        "sampler": bench_sampler(batches, [1000, 152064], args.reps),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
