"""``megarl plan``: print the Megatron → vLLM weight-sync plan for a model and two layouts.

    megarl plan --config configs/ppo_qwen2_5_72b.yaml            layouts and model from a config
    megarl plan --preset qwen2.5-72b --tp 8 --pp 4 --rollout-tp 8
    megarl plan --model /path/to/hf_model --tp 2 --rollout-tp 1 --bucket-mb 64 --buckets

Nothing is allocated and no process group is started; the plan is pure arithmetic.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from megarl.config.model_dims import ModelDims, read_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.rollout.reshard.plan import DEFAULT_BUCKET_BYTES, ReshardPlan, make_reshard_plan

__all__ = ["PRESETS", "main"]

_QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}
PRESETS: dict[str, dict] = {
    "qwen2.5-7b": {
        **_QWEN25,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    },
    "qwen2.5-32b": {
        **_QWEN25,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
    },
    "qwen2.5-72b": {
        **_QWEN25,
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
}
"""HF ``config.json`` shapes of common models, for planning without the model files."""

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megarl plan", description="Show how weights move from training to vLLM."
    )
    p.add_argument("--config", help="megarl YAML config (layouts, model path, dtype)")
    p.add_argument("--model", help="HF model directory or config.json")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a known model shape")
    p.add_argument("--tp", type=int, help="training tensor-parallel size")
    p.add_argument("--pp", type=int, help="training pipeline-parallel size")
    p.add_argument("--vpp", type=int, help="virtual pipeline chunks per stage")
    p.add_argument("--rollout-tp", type=int, help="vLLM tensor-parallel size")
    p.add_argument("--bucket-mb", type=float, help="bucket size limit in MiB (default 1024)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="parameter dtype (default bf16)")
    p.add_argument("--buckets", action="store_true", help="also list every bucket")
    p.add_argument("overrides", nargs="*", help="dotted config overrides (with --config)")
    return p


def _hf_config(args: argparse.Namespace, model_path: str | None) -> tuple[dict, str]:
    """The HF config dict and where it came from."""
    if args.model:
        path = Path(args.model)
        path = path / "config.json" if path.is_dir() else path
        return read_hf_config(path), str(path)
    if args.preset:
        return PRESETS[args.preset], f"preset {args.preset}"
    if model_path:
        from megarl.config.model_source import find_config_json

        found = find_config_json(model_path)
        if found is not None and found.is_file():
            return read_hf_config(found), str(found)
        key = model_path.lower().replace("_", ".")
        for name in sorted(PRESETS, key=len, reverse=True):
            if name in key:
                return PRESETS[name], f"preset {name} (matched {model_path!r})"
        raise SystemExit(f"error: no config.json for {model_path!r}; pass --model or --preset")
    raise SystemExit("error: give --config, --model or --preset")


def build_plan(args: argparse.Namespace) -> tuple[ReshardPlan, str]:
    """The plan the arguments describe, and the model's source."""
    tp = pp = rollout_tp = 1
    vpp = None
    dtype = "bf16"
    model_path = None
    if args.config:
        from megarl.config import load_config

        cfg = load_config(args.config, args.overrides)
        layout = cfg.actor_rollout_ref.actor.megatron.parallel_layout()
        tp, pp, vpp = layout.tp, layout.pp, layout.virtual_pipeline_model_parallel_size
        rollout_tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        dtype = cfg.trainer.dtype
        model_path = cfg.actor_rollout_ref.model.path
    elif args.overrides:
        raise SystemExit(f"error: overrides {args.overrides} need --config")
    tp = args.tp or tp
    pp = args.pp or pp
    vpp = args.vpp if args.vpp is not None else vpp
    rollout_tp = args.rollout_tp or rollout_tp
    dtype = args.dtype or dtype
    hf, source = _hf_config(args, model_path)
    dims = ModelDims.from_hf_config(hf, tp_size=tp)
    bucket = int(args.bucket_mb * (1 << 20)) if args.bucket_mb else DEFAULT_BUCKET_BYTES
    layout = ParallelLayout(tp, pp, vpp if vpp and vpp > 1 else None)
    plan = make_reshard_plan(dims, layout, rollout_tp, bucket_bytes=bucket, dtype=_DTYPES[dtype])
    return plan, source


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    start = time.perf_counter()
    try:
        plan, source = build_plan(args)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    print(f"source: {source}")
    print(plan.summary())
    print(f"plan computed in {elapsed * 1e3:.1f} ms")
    if args.buckets:
        mib = 1 << 20
        for b in plan.buckets:
            first, last = b.params[0].name, b.params[-1].name
            span = first if first == last else f"{first} .. {last}"
            print(f"  bucket {b.index:4d}  PP{b.pp_rank}  {b.nbytes / mib:9.2f} MiB  {span}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
