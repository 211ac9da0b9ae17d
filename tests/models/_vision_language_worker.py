"""The vision-language actor's checks at every layout of two ranks, in one torchrun launch
(test_vision_language.py): ``python -m torch.distributed.run --nproc_per_node 2
_vision_language_worker.py SPEC.json``.

For each tiny VL model and layout (TP 1 at DP 2, TP 2, PP 2), the largest |logit - HF logit|
over every row's tokens and the vocabulary (max over ranks). At TP 1 also two sabotaged forwards
whose logits must be far from HF's: the mrope sections permuted, the image embeddings left out
(the word embeddings of the placeholder token in their place). Rank 0 writes the results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = ((1, 1), (2, 1), (1, 2))
"""(TP, PP) of the checks: TP 1 (data-parallel 2), TP 2, PP 2."""


def _max_diff(logits: torch.Tensor | None, ref: torch.Tensor, lengths: torch.Tensor) -> float:
    """The largest |logits - ref| over this rank's vocabulary slice and every row's tokens,
    then over the ranks (0 from ranks without logits)."""
    from megatron.core import parallel_state

    diff = 0.0
    if logits is not None:
        local = logits.shape[-1]
        lo = parallel_state.get_tensor_model_parallel_rank() * local
        hi = min(lo + local, ref.shape[-1])
        for i, n in enumerate(lengths.tolist()):
            if hi > lo:
                diff = max(diff, (logits[i, :n, : hi - lo] - ref[i, :n, lo:hi]).abs().max().item())
    t = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sabotaged(model, batch, ref) -> dict[str, float]:
    """The logit differences of two forwards that must fail the comparison."""
    from megarl.models import vision_language as vl
    from megarl.models.gpt import unwrap

    gpt = unwrap(model.language.chunks[0])
    right = list(gpt.mrope_section)
    gpt.mrope_section = right[1:] + right[:1]
    permuted = _max_diff(vl.forward_logits(model, batch), ref, batch.lengths)
    gpt.mrope_section = right
    saved = vl.image_embeddings
    vl.image_embeddings = lambda _model, _batch: None  # the placeholders' word embeddings stay
    try:
        unplaced = _max_diff(vl.forward_logits(model, batch), ref, batch.lengths)
    finally:
        vl.image_embeddings = saved
    return {"mrope_permuted": permuted, "images_not_placed": unplaced}


def _refusals(path: str) -> dict[str, str]:
    """What building at a layout that is not built yet says, per layout."""
    from megarl.models import vision_language as vl
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    out = {}
    for key, layout in {"sp": ParallelLayout(2, 1, sequence_parallel=True),
                        "cp": ParallelLayout(1, 1, context_parallel_size=2)}.items():  # fmt: skip
        init_distributed(layout, seed=1234)
        try:
            vl.build_vision_language_model(path, layout, load_weights=False)
            out[key] = "built"
        except NotImplementedError as exc:
            out[key] = str(exc)
    return out


def _training(spec: dict, name: str, path: str, layout, key: str) -> dict:
    """The runner's passes on the training batch (``_vl_training.py``): fp32 log-probs for
    every model, the float64 update for the models and layouts ``spec["updates"]`` names."""
    from tests.models import _vl_training as training

    data = torch.load(Path(path) / "train.pt")
    out = {f"{key}/{name}/log_probs": training.log_prob_case(path, data, layout)}
    for case in spec["updates"].get(f"{key}/{name}", []):
        out[f"{key}/{name}/{case}"] = training.update_case(path, data, layout,
                                                           frozen=case == "frozen")  # fmt: skip
    return out


def main() -> None:
    from megarl.models import vision_language as vl
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.parallel.layout import ParallelLayout

    spec = json.loads(Path(sys.argv[1]).read_text())
    results: dict = {}
    for tp, pp in LAYOUTS:
        layout = ParallelLayout(tp, pp)
        init_distributed(layout, seed=1234)
        for name, path in spec["models"].items():
            data = torch.load(Path(path) / "batch.pt")
            batch = vl.ImageBatch(data["input_ids"], data["lengths"], data["pixel_values"],
                                  data["image_grid_thw"])  # fmt: skip
            ref = data["hf_logits"]
            model = vl.build_vision_language_model(path, layout)
            with torch.no_grad():
                r = {"logit_diff": _max_diff(vl.forward_logits(model, batch), ref, batch.lengths)}
                if (tp, pp) == (1, 1):
                    r.update(_sabotaged(model, batch, ref))
            r["vision_on_rank"] = model.vision is not None
            held = [None] * dist.get_world_size()
            dist.all_gather_object(held, r["vision_on_rank"])
            r["vision_on_ranks"] = held
            results[f"tp{tp}_pp{pp}/{name}"] = r
            results.update(_training(spec, name, path, layout, f"tp{tp}_pp{pp}"))
    results["refused"] = _refusals(next(iter(spec["models"].values())))
    if dist.get_rank() == 0:
        torch.save(results, Path(spec["tmp"]) / "results.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
