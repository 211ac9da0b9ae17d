"""MoE checks (Qwen3-MoE, Mixtral) run inside the shared multi-rank launch of each world size
(``_parallel_worker.py``): logits against transformers at TP×PP×EP(×ETP) layouts with both CPU
token dispatchers, HF export from each layout (the pytest side compares it bit for bit with the
source), and a dist checkpoint saved at one expert layout and loaded at another.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

# (tp, pp, ep, etp, dispatcher): EP 1/2, TP 1/2, PP 1/2, ETP = TP or 1, both dispatchers.
MOE_LAYOUTS = {
    1: [(1, 1, 1, None, "alltoall")],
    2: [
        (1, 1, 2, None, "alltoall"),
        (1, 1, 2, None, "allgather"),
        (2, 1, 1, None, "alltoall"),
        (1, 2, 1, None, "allgather"),
        (2, 1, 2, 1, "alltoall"),
    ],
    4: [(2, 2, 2, 1, "alltoall"), (1, 2, 2, None, "allgather")],
}


def layout_key(tp: int, pp: int, ep: int, etp: int | None, dispatcher: str) -> str:
    return f"moe/tp{tp}_pp{pp}_ep{ep}_etp{etp or tp}_{dispatcher}"


def _layout(tp, pp, ep, etp):
    from megarl.parallel.layout import ParallelLayout

    return ParallelLayout(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def _build(path: str, layout, dispatcher: str):
    from megarl.models.build import build_model
    from megarl.models.gpt import MoeSettings
    from megarl.parallel.init import init_distributed

    init_distributed(layout, seed=1234)
    moe = MoeSettings.from_dict({"moe_token_dispatcher_type": dispatcher})
    return build_model(path, layout, moe=moe)


def _logit_diff(chunks, dims, ids: torch.Tensor, lengths: torch.Tensor, ref: torch.Tensor) -> float:
    """max |Δlogit| over real positions against HF's logits (max over ranks)."""
    from megarl.models.runner import forward_logits, gather_vocab

    for c in chunks:
        c.eval()
    kept = forward_logits(chunks, list(ids.split(2)))
    diff = 0.0
    if kept is not None:
        logits = gather_vocab(torch.cat(kept), dims.vocab_size)
        for i, n in enumerate(lengths.tolist()):
            diff = max(diff, (logits[i, :n] - ref[i, :n]).abs().max().item())
    t = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_moe_checks(spec: dict, world: int, results: dict) -> None:
    from megarl.models.weights import export_hf_weights

    start = time.perf_counter()
    batch = torch.load(spec["moe_batch"])
    ids, lengths = batch["input_ids"], batch["lengths"]
    tmp = Path(spec["tmp"])
    for tp, pp, ep, etp, dispatcher in MOE_LAYOUTS[world]:
        key = layout_key(tp, pp, ep, etp, dispatcher)
        for name, path in spec["moe_models"].items():
            ref = torch.load(Path(path) / "ref_logits.pt")
            built = _build(path, _layout(tp, pp, ep, etp), dispatcher)
            r = {"logit_diff": _logit_diff(built.chunks, built.dims, ids, lengths, ref)}
            if dispatcher == "alltoall":  # the export does not depend on the dispatcher
                out = tmp / f"export_{key.replace('/', '_')}_{name}"
                export_hf_weights(built.chunks, out, built.dims, source_dir=path)
                r["export"] = str(out)
            results[f"{key}/{name}"] = r
    if world == 2:
        _checkpoint_across_expert_layouts(spec, results)
    results["moe/seconds"] = time.perf_counter() - start  # this launch's added time


def _checkpoint_across_expert_layouts(spec: dict, results: dict) -> None:
    """Save at EP=2, load at TP=2 (experts split by ETP=2 instead): every parameter equals the
    one loaded from HF at the target layout."""
    from megarl.checkpoint.dist_ckpt import load_model_checkpoint, save_model_checkpoint
    from megarl.models.build import build_model
    from megarl.models.weights import local_global_names

    path = spec["moe_models"]["qwen3_moe"]
    ckpt = Path(spec["tmp"]) / "moe_ckpt_ep2"
    src, dst = _layout(1, 1, 2, None), _layout(2, 1, 1, None)
    save_model_checkpoint(_build(path, src, "alltoall").chunks, ckpt, meta={"layout": "ep2"})
    direct = _build(path, dst, "alltoall")
    loaded = build_model(direct.dims, dst).chunks
    load_model_checkpoint(loaded, ckpt)
    pairs = zip(local_global_names(direct.chunks), local_global_names(loaded), strict=True)
    same = all(a[2] == b[2] and torch.equal(a[3], b[3]) for a, b in pairs)
    flag = torch.tensor([0 if same else 1])
    dist.all_reduce(flag)
    results["moe/ckpt_ep2_to_tp2"] = {"weights_identical": int(flag.item()) == 0}
