"""What real Megatron objects hold, for the memory planner's tests (one torchrun launch per world).

For every layout of the world size, role (actor, critic, tied actor), dtype (fp32; bf16 with
``grad_reduce_in_fp32``) and optimizer (distributed or not): build through
``megarl.models.build.build_model`` + ``TrainableModel``, run one micro-batched forward/backward
through the runner and one optimizer step, then count the bytes of the distinct storages each
rank holds in parameters, gradient buffers (``main_grad``), main parameters (optimizer
parameters that are not model storages) and optimizer states. At world size 1 it also measures
the bytes saved for backward in one training micro-batch (``saved_tensors_hooks``), with and
without recomputation. Rank 0 writes the results:
``python -m torch.distributed.run --nproc_per_node N _memory_worker.py SPEC.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = {1: [(1, 1)], 2: [(2, 1), (1, 2), (1, 1)]}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _held_bytes(trainable) -> dict[str, int]:
    params = [p for c in trainable.chunks for p in c.parameters()]
    param_st = _storages(params)
    grads = _storages(p.main_grad for p in params)
    main, states = {}, {}
    for leaf in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
        inner = leaf.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                ptr = p.untyped_storage().data_ptr()
                if ptr not in param_st:
                    main[ptr] = p.untyped_storage().nbytes()
        for state in inner.state.values():
            states.update(_storages(v for v in state.values() if isinstance(v, torch.Tensor)))
    return {
        "params": sum(param_st.values()),
        "grads": sum(grads.values()),
        "main_params": sum(main.values()),
        "optimizer_states": sum(states.values()),
    }


def _batch(n: int = 2, seq: int = 12):
    from megarl.models.runner import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (n, seq), generator=g)
    return SequenceBatch(ids, torch.full((n,), 4), torch.full((n,), seq))


def _step(trainable, role: str, vocab: int) -> None:
    from megarl.models.runner import forward_backward

    def loss_fn(outputs, mb):
        x = outputs["values"] if role == "critic" else outputs["log_probs"]
        return x.float().mean(), {}

    forward_backward(
        trainable.chunks,
        _batch(),
        loss_fn,
        micro_batches=1,
        vocab_size=None if role == "critic" else vocab,
    )
    assert trainable.step().updated


def _state_checks(spec: dict, tp: int, pp: int, results: list) -> None:
    from megatron.core import parallel_state as ps

    from megarl.models.build import build_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout(tp, pp)
    init_distributed(layout)
    cases = [("actor", "qwen2"), ("critic", "qwen2"), ("actor", "llama_tied")]
    for role, model in cases:
        for dtype, torch_dtype in DTYPES.items():
            for dist_opt in (False, True):
                built = build_model(spec["models"][model], layout, role=role, dtype=torch_dtype)
                settings = OptimizerSettings(
                    lr=1e-3, grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt
                )
                trainable = TrainableModel(built, settings)
                _step(trainable, role, built.dims.vocab_size)
                results.append(
                    {
                        "layout": [tp, pp, dist.get_world_size() // (tp * pp)],
                        "role": role,
                        "model": model,
                        "dtype": dtype,
                        "distributed_optimizer": dist_opt,
                        "pp_rank": ps.get_pipeline_model_parallel_rank(),
                        "dp_rank": ps.get_data_parallel_rank(),
                        **_held_bytes(trainable),
                    }
                )


def _saved_bytes(
    spec: dict, recompute, seq: int, micro_batch: int, role: str, dtype=torch.float32, grads=None
) -> int:
    """Bytes of distinct non-parameter storages saved for backward during the forward (and the
    gradients, one per parameter, appended to ``grads`` when given)."""
    from megarl.models.build import Recompute, build_model
    from megarl.models.runner import SequenceBatch, forward_backward
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout

    built = build_model(
        spec["models"]["qwen2"], ParallelLayout(), role=role, recompute=Recompute(*recompute),
        dtype=dtype,
    )  # fmt: skip
    trainable = TrainableModel(built, OptimizerSettings(lr=1e-3))
    params = _storages(p for c in trainable.chunks for p in c.parameters())
    saved: dict[int, int] = {}
    state = {"forward": True}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if state["forward"] and ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    def loss_fn(outputs, mb):
        state["forward"] = False  # the backward (and any recomputation) starts after this
        x = outputs["values"] if role == "critic" else outputs["log_probs"]
        return x.mean(), {}

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (micro_batch, seq), generator=g)
    batch = SequenceBatch(ids, torch.full((micro_batch,), 4), torch.full((micro_batch,), seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_backward(
            trainable.chunks,
            batch,
            loss_fn,
            micro_batches=micro_batch,
            vocab_size=None if role == "critic" else built.dims.vocab_size,
        )
    if grads is not None:
        grads.extend(p.main_grad.clone() for c in trainable.chunks for p in c.parameters())
    return sum(saved.values())


RECOMPUTES = [(None, None, None), ("full", "uniform", 1), ("full", "block", 1),
              ("full", "uniform", 2), ("selective", None, None),
              ("selective", None, None, ("core_attn", "mlp"))]  # fmt: skip
"""Megatron recompute settings whose gradients must equal those without recompute, bit for bit."""


def _recompute_gradient_checks(spec: dict, results: list) -> None:
    """Each of :data:`RECOMPUTES`, through ``build_model`` (``Recompute``, as ``megarl train``
    builds it from ``megatron.recompute_*``) and the runner: the gradients without and with it."""
    for role in ("actor", "critic"):
        plain: list = []
        plain_saved = _saved_bytes(spec, RECOMPUTES[0], 64, 2, role, grads=plain)
        for recompute in RECOMPUTES[1:]:
            grads: list = []
            saved = _saved_bytes(spec, recompute, 64, 2, role, grads=grads)
            same = len(grads) == len(plain) and all(
                torch.equal(a, b) for a, b in zip(grads, plain, strict=True)
            )
            diff = max(float((a - b).abs().max()) for a, b in zip(grads, plain, strict=True))
            results.append({"recompute_grads": True, "role": role, "recompute": list(recompute),
                            "identical": same, "max_diff": diff, "saved": saved,
                            "saved_without": plain_saved,
                            "nonzero": sum(int(g.count_nonzero()) for g in grads)})  # fmt: skip


def _activation_checks(spec: dict, results: list) -> None:
    for role in ("actor", "critic"):
        for recompute in [(None, None, None), ("full", "uniform", 1), ("full", "block", 1)]:
            for seq, micro_batch in [(64, 2), (160, 1)]:
                results.append(
                    {
                        "activations": True,
                        "role": role,
                        "recompute": list(recompute),
                        "seq": seq,
                        "micro_batch": micro_batch,
                        "saved": _saved_bytes(spec, recompute, seq, micro_batch, role),
                    }
                )
    for seq, micro_batch in [(64, 2), (160, 1)]:  # 16-bit: the fp32 softmax and norm copies
        saved = _saved_bytes(spec, (None, None, None), seq, micro_batch, "actor", torch.bfloat16)
        results.append({"activations": True, "role": "actor", "dtype": "bf16", "seq": seq,
                        "micro_batch": micro_batch, "recompute": [None] * 3, "saved": saved})  # fmt: skip


def _gpu_peak(spec: dict, results: list) -> None:
    """GPU only: ``torch.cuda.max_memory_allocated`` over building, one training micro-batch
    and one optimizer step of a mid-sized bf16 model (TE spec when it imports)."""
    from megarl.config.model_dims import ModelDims
    from megarl.models.build import build_model
    from megarl.models.gpt import transformer_engine_available
    from megarl.models.runner import SequenceBatch, forward_backward
    from megarl.models.tiny import tiny_hf_config
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout

    hf = tiny_hf_config("qwen2", **spec["gpu_model"])
    dims = ModelDims.from_hf_config(hf)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    impl = "transformer_engine" if transformer_engine_available() else "local"
    built = build_model(dims, ParallelLayout(), dtype=torch.bfloat16, transformer_impl=impl)
    trainable = TrainableModel(built, OptimizerSettings(lr=1e-5))
    b, s = spec["gpu_batch"]
    ids = torch.randint(0, dims.vocab_size, (b, s), device="cuda")
    batch = SequenceBatch(ids, torch.full((b,), 8), torch.full((b,), s))

    def loss_fn(outputs, mb):
        return outputs["log_probs"].float().mean(), {}

    # The allocator's history over the update: what is live at its peak goes with the result,
    # so that a planner miss on a GPU comes back with where the bytes went.
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    forward_backward(trainable.chunks, batch, loss_fn, micro_batches=b, vocab_size=dims.vocab_size)
    trainable.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    try:
        at_peak = _live_at_peak(torch.cuda.memory._snapshot())
    except Exception as exc:  # noqa: BLE001 - a diagnosis: its failure must not hide the peak
        at_peak = [[0, f"no breakdown: {type(exc).__name__}: {exc}"]]
    torch.cuda.memory._record_memory_history(enabled=None)
    # The residency moves (megarl/planner/residency.py): everything to host memory and back.
    weights = [p.detach().float().clone() for p in trainable.chunks[0].parameters()]
    before = torch.cuda.memory_allocated()
    trainable.place(params=False, grads=False, optimizer=False)
    freed = before - torch.cuda.memory_allocated()
    trainable.place(params=True, grads=True, optimizer=True)
    restored = torch.cuda.memory_allocated() - (before - freed)
    after = [p.detach().float() for p in trainable.chunks[0].parameters()]
    results.append(
        {
            "gpu": True,
            "peak": peak,
            "impl": impl,
            "offload_freed": freed,
            "reload_allocated": restored,
            "weights_restored": all(torch.equal(a, b) for a, b in zip(weights, after, strict=True)),
            "live_at_peak": at_peak,
        }
    )


def _live_at_peak(snapshot: dict, top: int = 25) -> list[list]:
    """Replay the recorded allocations: the largest blocks live when the most bytes were, as
    [bytes, where] (where: the innermost frames in megarl, Megatron or torch.nn)."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            frames = [
                f"{Path(f['filename']).name}:{f['line']} {f['name']}"
                for f in event.get("frames", [])
                if any(k in f["filename"] for k in ("megarl", "megatron", "torch/nn"))
            ]
            live[event["addr"]] = (event["size"], " < ".join(frames[:3]))
            total += event["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif event["action"] in ("free_requested", "free") and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return [list(v) for v in sorted(best_live.values(), key=lambda v: -v[0])[:top]]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.parallel.layout import ParallelLayout

    init_distributed(ParallelLayout())
    world = dist.get_world_size()
    results: list = []
    if "--gpu" in sys.argv:
        _gpu_peak(spec, results)
        Path(spec["tmp"], "memory_gpu.json").write_text(json.dumps(results))
        destroy_distributed()
        return
    for tp, pp in LAYOUTS[world]:
        _state_checks(spec, tp, pp, results)
    if world == 1:
        init_distributed(ParallelLayout())
        _activation_checks(spec, results)
        _recompute_gradient_checks(spec, results)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        out = Path(spec["tmp"]) / f"memory_ws{world}.json"
        out.write_text(json.dumps([r for rank in gathered for r in rank]))
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
