"""torchrun worker for tests/rollout/test_vllm_vision_language.py: vLLM on image prompts and the
VL actor's weight sync, every case in one 2-rank launch.

Run as ``torchrun --nproc_per_node 2 _vllm_vision_language_worker.py SPEC.json``. For each case
(family, the actor's TP and PP, vLLM's TP; vLLM TP 1 is rollout DP 2): build the Megatron VL
actor from the checkpoint and a vLLM engine that read no weights (``dummy``), then

1. sync the actor into vLLM (the first sync), generate the dataset's prompts;
2. perturb every actor weight, the vision tower's too, and sync the language model alone (the
   vision tower left out: a control that must fail on the image prompts only), generate;
3. sync everything, generate.

After each generation the actor scores the sampled responses (log_softmax(logits / T) at each
response token, fp64 from fp32 logits) and the largest |vLLM - actor| is recorded, apart for
the image prompts and the text prompt. Rank 0 writes ``results.json`` beside the spec.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

T = 0.7
N = 2
MAX_TOKENS = 8
NOISE = 0.5
"""Perturbation of each weight, in units of its own standard deviation."""


def perturb(model, seed: int) -> None:
    """Noise on every actor weight (language and vision): the same on the ranks that hold the
    same tensor (TP peers' replicated weights, the replicated vision tower, DP replicas), its
    own on each TP shard."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    named = dict(model.language.chunks[0].named_parameters())
    if model.vision is not None:  # the first pipeline stage
        named.update(model.vision.named_parameters())
    seen: set[int] = set()  # the tower may be a submodule of the chunk as well
    with torch.no_grad():
        for name, param in named.items():
            if id(param) in seen:
                continue
            seen.add(id(param))
            split = getattr(param, "tensor_model_parallel", False)
            key = zlib.crc32(name.encode()) + seed + (1_000_003 * tp_rank if split else 0)
            gen = torch.Generator().manual_seed(key)
            noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
            scale = param.float().std().item() if param.numel() > 1 else 1.0
            param.add_(noise * NOISE * (scale or 1.0))


def actor_logprobs(model, batch, samples, vocab_size: int) -> list[list[float]] | None:
    """The actor's log_softmax(logits / T) at each sampled response token of ``batch`` (its
    prompts' ``samples`` give the pixels), one forward of all responses; None on a pipeline
    stage without logits."""
    from megatron.core import parallel_state

    from megarl.models import vision_language as vl

    rows = [s.prompt_token_ids + s.response_token_ids for s in batch]
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    inputs = [samples[s.prompt_index].multi_modal_inputs for s in batch]
    pixels = [m["pixel_values"] for m in inputs if m is not None]
    grids = [m["image_grid_thw"] for m in inputs if m is not None]
    image_batch = vl.ImageBatch(ids, lengths, torch.cat(pixels) if pixels else None,
                                torch.cat(grids) if grids else None)  # fmt: skip
    with torch.no_grad():
        logits = vl.forward_logits(model, image_batch)
    if logits is None:
        return None
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits, group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(parts, -1)
    logp = torch.log_softmax(logits[..., :vocab_size].double() / T, -1)
    out = []
    for i, s in enumerate(batch):
        start = len(s.prompt_token_ids) - 1  # position t scores token t + 1
        steps = logp[i, start : start + len(s.response_token_ids)]
        out.append(steps.gather(-1, torch.tensor(s.response_token_ids)[:, None])[:, 0].tolist())
    return out


def compare(model, batch, samples, vocab_size: int) -> dict:
    """Largest |vLLM - actor| log-prob over the image prompts' and the text prompt's tokens,
    and the tokens compared (max over ranks: at PP 2 only the last stage compares)."""
    actor = actor_logprobs(model, batch, samples, vocab_size)
    worst = {"image": 0.0, "text": 0.0}
    tokens = 0
    for s, lp in zip(batch, actor or [], strict=actor is not None):
        kind = "text" if samples[s.prompt_index].images is None else "image"
        diff = max((abs(a - b) for a, b in zip(s.response_logprobs, lp, strict=True)), default=0)
        worst[kind] = max(worst[kind], diff)
        tokens += len(lp)
    t = torch.tensor([worst["image"], worst["text"], tokens], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"image": t[0].item(), "text": t[1].item(), "tokens": int(t[2])}


def run_case(family: str, tp: int, pp: int, rollout_tp: int, path: str, parquet: str,
             seed: int) -> dict:  # fmt: skip
    from transformers import AutoTokenizer

    from megarl.data.dataset import PromptDataset
    from megarl.data.tokenizer import load_image_processor
    from megarl.models import vision_language as vl
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.rollout.reshard import sync_weights
    from megarl.rollout.reshard.vision_sync import (
        plan_for_vision_language,
        sync_vision_language_weights,
    )
    from megarl.rollout.vllm_engine import VLLMEngine

    timings: dict = {}
    t = time.perf_counter()
    layout = ParallelLayout(tp, pp)
    init_distributed(layout, seed=1234)
    model = vl.build_vision_language_model(path, layout)
    tok = AutoTokenizer.from_pretrained(path)
    ds = PromptDataset(parquet, tok, image_processor=load_image_processor(path), shuffle=False,
                       max_prompt_length=96, limit_images=2)  # fmt: skip
    samples = [ds[i] for i in range(len(ds))]
    timings["actor_s"] = time.perf_counter() - t
    t = time.perf_counter()
    engine = VLLMEngine(path, tensor_parallel_size=rollout_tp, seed=0, max_model_len=128, dtype="float32",
                        kv_cache_memory_bytes=16 << 20, max_num_seqs=16, load_weights=False,
                        limit_images=2)  # fmt: skip
    timings["engine_s"] = time.perf_counter() - t
    vocab = model.language.dims.vocab_size
    plan = plan_for_vision_language(model, rollout_tp, bucket_bytes=256 << 10)
    prompts = [s.prompt_ids for s in samples]
    images = [s.images for s in samples]

    def generate(step: int):
        return engine.generate(prompts, n=N, temperature=T, max_tokens=MAX_TOKENS, seed=seed,
                               step=step, images=images)  # fmt: skip

    out: dict = {"prompt_lengths": [len(p) for p in prompts],
                 "images": [len(i or ()) for i in images]}  # fmt: skip
    t = time.perf_counter()
    stats = sync_vision_language_weights(model, plan, engine)
    timings["sync_s"] = time.perf_counter() - t
    out["sync_bytes"] = stats.bytes
    out["language_bytes"] = sum(b.nbytes for b in plan.buckets)
    t = time.perf_counter()
    first = generate(0)
    timings["generate_s"] = time.perf_counter() - t
    out["first"] = compare(model, first, samples, vocab)
    # generate checks that vLLM widened each image to the dataset's tokens: one token short
    short = list(prompts[0])
    short.remove(engine.image_token_id)
    try:
        engine.generate([short], n=1, temperature=T, max_tokens=2, seed=seed, images=images[:1])
        out["short_prompt"] = "generated"
    except RuntimeError as exc:
        out["short_prompt"] = str(exc)
    perturb(model, seed)
    sync_weights(model.language.chunks, plan, engine)  # the control: the vision tower left out
    out["language_only"] = compare(model, generate(1), samples, vocab)
    t = time.perf_counter()
    sync_vision_language_weights(model, plan, engine)
    timings["second_sync_s"] = time.perf_counter() - t
    out["perturbed"] = compare(model, generate(2), samples, vocab)
    out["responses"] = [s.response_token_ids for s in first]
    engine.shutdown()
    out["timings"] = timings
    return out


def main() -> None:
    from megarl.parallel.init import destroy_distributed

    spec_path = Path(sys.argv[1])
    spec = json.loads(spec_path.read_text())
    t0 = time.perf_counter()
    results: dict = {}
    for i, (key, family, tp, pp, rollout_tp) in enumerate(spec["cases"]):
        t = time.perf_counter()
        r = run_case(family, tp, pp, rollout_tp, spec["models"][family], spec["parquet"], 7 + i)
        r["timings"]["case_s"] = time.perf_counter() - t
        results[key] = r
    results["total_s"] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        (spec_path.parent / "results.json").write_text(json.dumps(results))
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
