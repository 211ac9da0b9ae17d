"""``megarl plan``: will a config fit on the GPUs, and which layouts do if it does not.

    megarl plan --config configs/ppo_qwen2_5_72b.yaml [KEY=VALUE ...] [--gpu-memory 80]
                [--nodes N --gpus-per-node G] [--reserve 4] [--model DIR | --preset NAME] [--json]
    megarl plan reshard ...        the Megatron → vLLM weight-sync plan (``plan_reshard``)

Per phase of a step (setup, generate, reward, old_log_prob, ref, values, update_critic,
update_actor, sync, checkpoint: the residency schedule the trainer applies,
:mod:`megarl.planner.residency`) a table of the per-GPU terms with their formulas, FITS / DOES
NOT FIT against the GPU memory minus a reserve, host RAM per node, the vLLM KV cache, and a
verdict naming the phases over the limit (or the peak phase) and each one's biggest term; when a
phase does not fit, the cheapest layouts and switches that do, as overrides. MoE models: the
experts' terms apart (per EP rank, over expert DP) and EP × ETP in the search. Pure arithmetic
(:mod:`megarl.planner.memory_plan`): no process, no tensor.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

from megarl.commands.plan_args import InputError, OneLineParser, positive_float, positive_int
from megarl.config.errors import ConfigError
from megarl.config.model_dims import ModelDims
from megarl.parallel.layout import shape_layout_problems
from megarl.planner.memory import GIB
from megarl.planner.memory_plan import Cluster, MemoryPlan, plan_memory
from megarl.planner.memory_search import Proposal, search_layouts
from megarl.planner.model_presets import PRESETS, hf_config_at, resolve_hf_config

__all__ = ["PRESETS", "main"]

MEG = "actor_rollout_ref.actor.megatron"
_LAYOUT_KEYS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
}


def _parser() -> OneLineParser:
    p = OneLineParser(prog="megarl plan", description="Will a config fit on its GPUs?")
    p.add_argument("--config", "-c", action="append", default=[], help="megarl YAML config")
    p.add_argument(
        "--gpu-memory",
        type=positive_float,
        default=None,
        help="GiB per GPU (default: this GPU's, else 79.2, an H100 as CUDA reports it)",
    )
    p.add_argument("--reserve", type=positive_float, default=4.0, help="GiB kept free (4)")
    p.add_argument("--nodes", type=positive_int, help="nodes (default trainer.nnodes)")
    p.add_argument("--gpus-per-node", type=positive_int, help="default trainer.n_gpus_per_node")
    p.add_argument("--model", help="HF model directory or config.json (instead of the config's)")
    p.add_argument("--preset", help=f"a known model shape: {', '.join(sorted(PRESETS))}")
    p.add_argument("--propose", type=positive_int, default=5, help="layouts to propose (5)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    return p


def build(args) -> tuple[MemoryPlan, list[Proposal], str]:
    """The plan, the proposals (only when it does not fit) and the model's source."""
    from megarl.config import load_config, validate

    if not args.config:
        raise InputError("give --config FILE (or `megarl plan reshard ...` for the sync plan)")
    cfg = load_config(args.config, args.overrides)
    nodes = args.nodes or cfg.trainer.nnodes
    gpus = args.gpus_per_node or cfg.trainer.n_gpus_per_node
    cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node = nodes, gpus
    from megarl.planner.fit_warning import gpu_memory_gib

    gpu_memory = args.gpu_memory or gpu_memory_gib()
    cluster = Cluster(nodes, gpus, gpu_memory, args.reserve)
    if args.reserve >= gpu_memory:
        raise InputError(f"--reserve {args.reserve:g} GiB leaves nothing of --gpu-memory")
    validate(cfg, cluster.world)  # a ConfigError names the keys
    if args.model:
        hf, source = hf_config_at(args.model)
    else:
        hf, source = resolve_hf_config(cfg.actor_rollout_ref.model, preset=args.preset)
    dims = ModelDims.from_hf_config(hf)
    # validate() checked the layout against the config's own model; --model/--preset may differ
    layout = cfg.actor_rollout_ref.actor.megatron.parallel_layout()
    problems = shape_layout_problems(layout, dims.known())
    if problems:
        values = {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "ep": layout.ep,
                  "etp": layout.etp}  # fmt: skip
        names = {k: f"{MEG}.{key}={values[k]}" for k, key in _LAYOUT_KEYS.items()}
        text = "; ".join(p.describe(**names) for p in problems)
        raise InputError(f"the layout does not fit the model of {source}: {text}")
    plan = plan_memory(cfg, dims, cluster)
    proposals = [] if plan.fits else search_layouts(cfg, dims, cluster, limit=args.propose)
    return plan, proposals, source


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def render(plan: MemoryPlan, proposals: list[Proposal], source: str) -> str:
    """The human-readable plan."""
    c, lay = plan.cluster, plan.layout
    lines = [
        f"model: {source}",
        (
            f"cluster: {c.nodes} node(s) × {c.gpus_per_node} GPU(s) of {c.gpu_memory_gib:g} GiB; "
            f"usable per GPU {c.gpu_memory_gib - c.reserve_gib:g} GiB "
            f"(reserve {c.reserve_gib:g} GiB)"
        ),
        (
            f"training TP {lay.tp} × PP {lay.pp} × VPP {lay.vpp}"
            + (f" × CP {lay.cp}" if lay.cp > 1 else "")
            + f" → DP {lay.data_parallel_size(c.world)}"
        ),
    ]
    if plan.rollout_gpus:
        lines.append(
            f"rollout: vLLM on {plan.rollout_gpus} GPU(s) of its own (phase 'rollout ranks')"
        )
    if plan.teacher_gpus:
        named = [ph.name for ph in plan.phases if ph.name.startswith("teacher ranks")]
        phases = ", ".join(f"'{name}'" for name in named)
        lines.append(
            f"teacher: vLLM on {plan.teacher_gpus} GPU(s) of its own (phase{'s' * (len(named) > 1)} "
            f"{phases})"
        )
    if plan.moe:
        lines.append(
            f"experts: EP {lay.ep} × expert TP {lay.etp} × PP {lay.pp} → expert DP "
            f"{lay.expert_data_parallel_size(c.world)}"
        )
    for phase in plan.phases:
        verdict = "FITS" if plan.phase_fits(phase) else "DOES NOT FIT"
        lines.append(f"\nphase {phase.name}: {_gib(phase.total)} per GPU  {verdict}")
        lines += [f"  {_gib(t.nbytes)}  {t.name:<48} {t.formula}" for t in phase.terms]
    kv = plan.kv_cache
    lines.append(
        f"\nvLLM KV cache per rank: {_gib(kv['bytes'])} = {kv['tokens']:.0f} tokens "
        f"({kv['bytes_per_token']} B each) = {kv['sequences']:.1f} sequences of the configured "
        f"length; weights {_gib(kv['weights_bytes']).strip()}, activation profile "
        f"{_gib(kv['activation_profile_bytes']).strip()}, CUDA graphs "
        f"{_gib(kv['cuda_graph_bytes']).strip()}"
        + ("  (NO ROOM: vLLM will not start)" if kv["bytes"] <= 0 else "")
    )
    host = sum(t.nbytes for t in plan.host_ram_per_node)
    lines.append(f"host RAM per node: {_gib(host)}")
    lines += [f"  {_gib(t.nbytes)}  {t.name:<48} {t.formula}" for t in plan.host_ram_per_node]
    lines.append("assumptions: " + "; ".join(plan.assumptions))
    lines.append(f"\nverdict: {'FITS' if plan.fits else 'DOES NOT FIT'}: {plan.reason()}")
    if not plan.fits:
        lines.append(
            "layouts that fit (sorted: no offload, TP within a node, less pipeline bubble, "
            "no recompute, lower peak):"
            if proposals
            else "no layout of the search fits"
        )
        for p in proposals:
            experts = f" × EP {p.ep} × ETP {p.etp}" if plan.moe else ""
            lines.append(
                f"  TP {p.tp} × PP {p.pp}{experts}, offload {'on' if p.offload else 'off'}, "
                f"recompute {'full' if p.recompute else 'off'}, bubble {p.bubble:.0%}, peak "
                f"{_gib(p.plan.peak).strip()}\n    {' '.join(p.overrides)}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["reshard"]:
        from megarl.commands import plan_reshard

        return plan_reshard.main(argv[1:])
    start = time.perf_counter()
    try:
        args = _parser().parse_args(argv)
        plan, proposals, source = build(args)
    except (InputError, ConfigError, OSError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if args.json:
        out = plan.to_dict()
        out["source"] = source
        out["proposals"] = [
            {"tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.etp, "offload": p.offload,
             "recompute": p.recompute, "bubble": p.bubble, "peak_bytes": p.plan.peak,
             "overrides": list(p.overrides)}
            for p in proposals
        ]  # fmt: skip
        print(json.dumps(out, indent=1))
    else:
        print(render(plan, proposals, source))
        print(f"planned in {time.perf_counter() - start:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
