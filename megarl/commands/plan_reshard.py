"""``megarl plan reshard``: the Megatron → vLLM weight-sync plan for a model and two layouts.

    megarl plan reshard --config configs/ppo_qwen2_5_72b.yaml    layouts and model from a config
    megarl plan reshard --preset qwen2.5-72b --tp 8 --pp 4 --rollout-tp 8
    megarl plan reshard --model /path/to/hf_model --tp 2 --rollout-tp 1 --bucket-mb 64 --buckets
    megarl plan reshard --preset qwen3-30b-a3b --tp 4 --ep 8 --etp 1 --rollout-tp 8   (MoE)
    megarl plan reshard --preset qwen3-30b-a3b --tp 4 --ep 8 --rollout-tp 8 --rollout-ep

Nothing is allocated and no process group is started; the plan is pure arithmetic.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from megarl.commands.plan_args import InputError, OneLineParser, positive_int
from megarl.config.errors import ConfigError
from megarl.config.model_dims import ModelDims
from megarl.parallel.layout import ParallelLayout
from megarl.planner.model_presets import PRESETS, hf_config_at, preset_config
from megarl.rollout.reshard.make_plan import make_reshard_plan
from megarl.rollout.reshard.plan import DEFAULT_BUCKET_BYTES, ReshardPlan

__all__ = ["PRESETS", "build_plan", "main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="megarl plan reshard", description="Show how weights move from training to vLLM."
    )
    p.add_argument("--config", help="megarl YAML config (layouts, model path, dtype)")
    p.add_argument("--model", help="HF model directory or config.json")
    p.add_argument("--preset", help=f"a known model shape: {', '.join(sorted(PRESETS))}")
    p.add_argument("--tp", type=positive_int, help="training tensor-parallel size")
    p.add_argument("--pp", type=positive_int, help="training pipeline-parallel size")
    p.add_argument("--vpp", type=positive_int, help="virtual pipeline chunks per stage")
    p.add_argument("--ep", type=positive_int, help="expert-parallel size (MoE models)")
    p.add_argument("--etp", type=positive_int, help="expert tensor-parallel size (default TP)")
    p.add_argument("--rollout-tp", type=positive_int, help="vLLM tensor-parallel size")
    p.add_argument(
        "--rollout-ep",
        action="store_true",
        help="vLLM expert parallelism: each vLLM rank holds whole experts (MoE models)",
    )
    p.add_argument("--bucket-mb", type=float, help="bucket size limit in MiB (default 1024)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="parameter dtype (default bf16)")
    p.add_argument("--buckets", action="store_true", help="also list every bucket")
    p.add_argument("overrides", nargs="*", help="dotted config overrides (with --config)")
    return p


def _hf_config(args: argparse.Namespace, model_path: str | None) -> tuple[dict, str]:
    """The HF config dict and where it came from."""
    if args.model:
        return hf_config_at(args.model)
    if args.preset:
        return preset_config(args.preset), f"preset {args.preset}"
    if model_path:
        from megarl.config.model_source import find_config_json

        found = find_config_json(model_path)
        if found is not None and found.is_file():
            return hf_config_at(str(found))
        key = model_path.lower().replace("_", ".")
        for name in sorted(PRESETS, key=len, reverse=True):
            if name in key:
                return PRESETS[name], f"preset {name} (matched {model_path!r})"
        raise InputError(f"no config.json for {model_path!r}; pass --model or --preset")
    raise InputError("give --config, --model or --preset")


def build_plan(args: argparse.Namespace) -> tuple[ReshardPlan, str]:
    """The plan the arguments describe, and the model's source."""
    tp = pp = rollout_tp = ep = 1
    vpp = etp = None
    rollout_ep = False
    dtype = "bf16"
    model_path = None
    split: dict = {}  # the config's uneven layer split, if any
    if args.config:
        from megarl.config import load_config

        cfg = load_config(args.config, args.overrides)
        layout = cfg.actor_rollout_ref.actor.megatron.parallel_layout()
        tp, pp, vpp = layout.tp, layout.pp, layout.virtual_pipeline_model_parallel_size
        ep, etp = layout.ep, layout.expert_tensor_parallel_size
        split = layout.pipeline_split()
        rollout_tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        rollout_ep = cfg.actor_rollout_ref.rollout.expert_parallel_size > 1
        dtype = cfg.trainer.dtype
        model_path = cfg.actor_rollout_ref.model.path
    elif args.overrides:
        raise InputError(f"overrides {args.overrides} need --config")
    tp = args.tp or tp
    pp = args.pp or pp
    vpp = args.vpp if args.vpp is not None else vpp
    ep = args.ep or ep
    etp = args.etp or etp
    rollout_tp = args.rollout_tp or rollout_tp
    rollout_ep = args.rollout_ep or rollout_ep
    dtype = args.dtype or dtype
    hf, source = _hf_config(args, model_path)
    dims = ModelDims.from_hf_config(hf, tp_size=tp)
    bucket = int(args.bucket_mb * (1 << 20)) if args.bucket_mb else DEFAULT_BUCKET_BYTES
    layout = ParallelLayout(
        tp,
        pp,
        vpp if vpp and vpp > 1 else None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        **split,
    )
    plan = make_reshard_plan(
        dims, layout, rollout_tp, bucket_bytes=bucket, dtype=_DTYPES[dtype], rollout_ep=rollout_ep
    )
    return plan, source


def main(argv: Sequence[str] | None = None) -> int:
    start = time.perf_counter()
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        plan, source = build_plan(args)
    except (InputError, ConfigError, OSError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
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
