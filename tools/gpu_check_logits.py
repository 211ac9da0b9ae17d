"""The logits section of ``tools/gpu_check.py``, one rank under torchrun:
``gpu_check_logits.py SPEC.json``. Per model of the spec: Megatron's logits with the local spec
(and the Transformer Engine spec where it imports) against transformers', in fp32 and, on CUDA,
bf16; writes the max differences to the spec's ``result``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path


def main(spec_path: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.models.build import build_model
    from megarl.models.gpt import transformer_engine_available
    from megarl.models.runner import forward_logits
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    spec = json.loads(spec_path.read_text())
    init_distributed(ParallelLayout(), seed=0)
    device = torch.device("cuda" if spec["cuda"] else "cpu")
    # On CUDA both fp32 (the implementations must agree: <= 1e-3) and bf16, whose distance from
    # HF is judged against HF's own bf16 distance from its fp32 logits (the rounding floor: a
    # random model's logits amplify bf16 rounding layer after layer).
    dtypes = [torch.float32, torch.bfloat16] if spec["cuda"] else [torch.float32]
    impls = ["local"] + (["transformer_engine"] if spec["cuda"] and transformer_engine_available()
                         else [])  # fmt: skip
    results = {}
    for name, path in spec["models"].items():
        config = json.loads((Path(path) / "config.json").read_text())
        vocab = config["vocab_size"]
        ids = torch.randint(vocab, (2, 64), generator=torch.Generator().manual_seed(0))
        logits = {}
        for dtype in dtypes:
            tag = str(dtype).removeprefix("torch.")
            for impl in impls:
                model = build_model(path, ParallelLayout(), dtype=dtype, transformer_impl=impl)
                (out,) = forward_logits(model.chunks, [ids.to(device)])
                logits[impl, tag] = out[..., :vocab].float().cpu()
                del model
                torch.cuda.empty_cache() if spec["cuda"] else None
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
            with torch.no_grad():
                logits["hf", tag] = hf(ids.to(device)).logits[..., :vocab].float().cpu()
            del hf
            torch.cuda.empty_cache() if spec["cuda"] else None

        row = {"logit_scale": float(logits["hf", "float32"].abs().max())}
        for dtype in dtypes:
            tag = str(dtype).removeprefix("torch.")
            for impl in impls:
                row[f"{impl}_vs_hf_{tag}"] = _max_diff(logits, (impl, tag), ("hf", tag))
            if tag != "float32":  # each against the fp32 reference, HF's own rounding beside it
                row[f"hf_{tag}_vs_hf_float32"] = _max_diff(logits, ("hf", tag), ("hf", "float32"))
                for impl in impls:
                    row[f"{impl}_{tag}_vs_hf_float32"] = _max_diff(
                        logits, (impl, tag), ("hf", "float32")
                    )
        results[name] = row
    Path(spec["result"]).write_text(json.dumps(results))
    return 0


def _max_diff(logits: dict, a: tuple[str, str], b: tuple[str, str]) -> float:
    return float((logits[a] - logits[b]).abs().max())


if __name__ == "__main__":
    # Megatron warns at import that TE/apex are missing; gpu_check's stack row says so once.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*not installed")
    sys.exit(main(Path(sys.argv[1])))
