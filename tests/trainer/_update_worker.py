"""One actor update on a fixed batch at every layout of one world size (one torchrun launch).

For each layout and case the actor is built from the tiny HF checkpoint, updated once by
``megarl.trainer.update.update_policy`` (the product's code path) and its weights are gathered in
HF names; rank 0 saves them with the metrics for the pytest side, which compares them with an
independent single-process reference (``transformers`` + ``megarl.algo``):
``python -m torch.distributed.run --nproc_per_node W _update_worker.py SPEC.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = {
    1: [(1, 1, None, False, 1, False)],
    2: [
        (2, 1, None, False, 1, False),
        (1, 2, None, False, 1, True),
        (1, 1, None, False, 1, True),
        (1, 2, 2, False, 1, False),
        (1, 1, None, False, 2, True),
    ],
    4: [(2, 1, None, True, 1, False), (2, 2, None, False, 1, True), (2, 1, None, False, 2, True)],
}
"""(TP, PP, VPP, distributed optimizer, CP, packed rows) per world size; DP is what remains."""
UNEVEN_LAYOUTS = {2: [(1, 2, None, False, 1, True)]}
"""Layouts run again with Megatron's uneven layer split (``spec["uneven"]``): ``..._first1``."""
MOE_LAYOUTS = {
    2: [(1, 1, None, False, 2, False)],
    4: [(1, 2, None, True, 2, True), (2, 1, None, False, 2, False)],
}
"""The tiny Qwen3-MoE at (TP, PP, VPP, distributed optimizer, EP, packed rows): EP 2 (DP 2,
expert-DP 1), PP 2 × EP 2 with the distributed optimizer (DP 2, expert-DP 1), packed, and TP 2 ×
EP 2 (DP 2; expert TP 2, Megatron's default, so the alltoall dispatcher gathers unequal token
counts over it; MoE layers train at TP > 1 under sequence parallelism only)."""


def sequence_parallel(world: int, tp: int) -> bool:
    """At world 4 every TP 2 layout runs Megatron's sequence parallelism (the trainer's default,
    verl's ``megatron.sequence_parallel=true``; on CPU the local spec's marked norms,
    ``megarl.models.gpt.TorchNorm``); world 2's TP 2 runs without it."""
    return world == 4 and tp > 1


def layout_key(world: int, tp: int, pp: int, vpp, dist_opt: bool, cp: int = 1, pack=False) -> str:
    """The results' key of a layout, e.g. ``tp2_pp1_vpp1_cp2_dp1_packed`` (``_sp``: sequence
    parallelism)."""
    cp_part = f"_cp{cp}" if cp > 1 else ""
    return (
        f"tp{tp}_pp{pp}_vpp{vpp or 1}{cp_part}_dp{world // (tp * pp * cp)}"
        + ("_distopt" if dist_opt else "")
        + ("_packed" if pack else "")
        + ("_sp" if sequence_parallel(world, tp) else "")
    )


def _hf_weights(chunks, dims) -> dict[str, torch.Tensor]:
    """Every parameter, TP-merged, in HF names, on every rank (MoE experts from every
    expert-parallel rank)."""
    from megarl.models.weights import holds_first_copy, iter_full_hf_tensors

    local = {
        name: tensor.detach().float().clone()
        for name, tensor, expert in iter_full_hf_tensors(chunks, dims, with_expert_flag=True)
        if holds_first_copy(expert)
    }
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, local)
    merged: dict[str, torch.Tensor] = {}
    for box in boxes:
        merged.update(box)
    return merged


def _replicas_identical(chunks) -> bool:
    """All data-parallel replicas hold bit-identical parameters (a float64 checksum per tensor):
    dense ones over DP, MoE experts over expert-DP."""
    from megatron.core import parallel_state

    from megarl.models import moe_mapping as mm
    from megarl.models.weights import local_global_names
    from megarl.parallel.collectives import all_gather_tensors

    same = True
    for expert, group in (
        (False, parallel_state.get_data_parallel_group()),
        (True, parallel_state.get_expert_data_parallel_group()),
    ):
        sums = torch.tensor(
            [
                float(p.detach().double().sum())
                for _, _, name, p in local_global_names(chunks)
                if mm.is_expert_param(name) == expert
            ],
            dtype=torch.float64,
        )
        parts = all_gather_tensors(sums, group)
        same &= all(torch.equal(parts[0], p) for p in parts)
    return same


def _rollout(spec: dict, case: dict | None = None):
    """The fixed batch; a ``multi_turn`` case's with its tool turns (``response_mask`` 0 there)
    and the advantages computed on that mask."""
    from megarl.trainer.batch import rollout_batch

    data = torch.load(spec["batch"])
    multi_turn = bool(case and case.get("multi_turn"))
    batch = rollout_batch(
        data["prompts"],
        data["responses"],
        [[0.0] * len(r) for r in data["responses"]],
        data["prompt_ids"],
        [False] * len(data["responses"]),
        pad_token_id=0,
        token_masks=data["token_masks"] if multi_turn else None,
    )
    names = ["advantages", "old_log_probs", "ref_log_probs", "values", "returns"]
    if case and case.get("distillation"):
        names += ["teacher_log_probs"]
        if case["distillation"]["loss_mode"] == "forward_kl_topk":
            names += ["teacher_topk_log_probs", "teacher_topk_ids"]
    for name in names:
        if name in data:
            setattr(batch, name, data[name])
    if multi_turn:
        batch.advantages = data["mt_advantages"]
    return batch


BUCKET = 20_000
"""Parameters per DDP gradient bucket: several buckets (the tiny model has some 0.5M parameters), so
that with the overlaps on (the default) reduce-scatters launch bucket by bucket from the
backward pass and the deferred parameter all-gathers chain from bucket to bucket."""


def _enter_weight_read(model) -> None:
    """What the trainer does before it reads weights outside a forward (the weight sync to the
    engine, a checkpoint): enter a residency phase, i.e. ``place`` with nothing to move, which
    first finishes the parameter all-gather the distributed optimizer deferred."""
    model.place(**dict(zip(("params", "grads", "optimizer"), model.residency, strict=True)))


def _run_case(
    spec: dict, layout, case: dict, optimizer: str, model: str | None = None, split=None
) -> dict:
    from megarl.models.build import build_model
    from megarl.models.gpt import MoeSettings
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout
    from megarl.trainer.losses import Distillation
    from megarl.trainer.update import PolicyUpdate, update_policy

    tp, pp, vpp, dist_opt, cp_or_ep, pack = layout
    ep = [cp_or_ep] if model is not None else []
    cp = 1 if model is not None else cp_or_ep
    # float64 wherever Megatron allows it (its distributed optimizer takes fp32/bf16 only), so
    # that the comparison measures the parallel arithmetic, not fp32 rounding.
    exact = optimizer != "adamw_fp32" and not (optimizer == "adamw" and dist_opt)
    dtype = torch.float64 if exact else torch.float32
    if case.get("bf16"):
        dtype = torch.bfloat16
    sp = sequence_parallel(dist.get_world_size(), tp)
    built = build_model(
        model or spec["model"],
        ParallelLayout(
            tp,
            pp,
            vpp,
            sequence_parallel=sp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep[0] if ep else 1,
            **(split or {}),
        ),
        dtype=dtype,
        moe=MoeSettings.from_dict(case.get("moe", {})),
    )
    built.pack = pack
    if optimizer == "sgd":
        settings = OptimizerSettings(
            lr=case.get("lr", 1.0),
            optimizer="sgd",
            weight_decay=0.0,
            clip_grad=0.0,
            grad_reduce_in_fp32=dtype == torch.bfloat16,
            use_distributed_optimizer=False,
            ddp_bucket_size=BUCKET,
        )
    else:
        settings = OptimizerSettings(
            lr=1e-3,
            weight_decay=0.1,
            eps=spec["adam_eps"],
            clip_grad=1.0,
            grad_reduce_in_fp32=dtype != torch.float64,
            use_distributed_optimizer=dist_opt,
            ddp_bucket_size=BUCKET,
        )
    actor = TrainableModel(built, settings)
    update = PolicyUpdate(
        responses_per_mini_batch=case.get(
            "responses_per_mini_batch", spec["responses_per_mini_batch"]
        ),
        micro_batch_size=None if case["dynamic"] else spec["micro_batch_size"],
        max_token_len=spec["max_token_len"] if case["dynamic"] else None,
        loss_agg_mode=case["loss_agg_mode"],
        loss_scale_factor=case.get("loss_scale_factor"),
        entropy_coeff=spec["entropy_coeff"],
        use_kl_loss=True,
        kl_loss_coef=spec["kl_loss_coef"],
        kl_loss_type="low_var_kl",
        temperature=spec["temperature"],
        balance=case["dynamic"],  # token-balanced DP shares in the dynamic case
        policy_loss_kwargs=spec["clip"],
        distillation=Distillation(**case["distillation"]) if case.get("distillation") else None,
    )
    metrics = update_policy(
        actor, _rollout(spec, case), update, vocab_size=built.dims.vocab_size, seed=0, step=1
    ).metrics
    _enter_weight_read(actor)
    from megarl.models.gpt import unwrap

    layers = [len(unwrap(chunk).decoder.layers) for chunk in actor.chunks]
    stage_layers = [None] * dist.get_world_size()
    dist.all_gather_object(stage_layers, layers)
    return {
        "stage_layers": stage_layers,  # each rank's transformer layers per chunk
        "dtype": str(dtype),
        "weights": _hf_weights(actor.chunks, built.dims),
        "metrics": metrics,
        "replicas_identical": _replicas_identical(actor.chunks),
    }


def _critic_case(spec: dict, layout, split=None) -> dict:
    """One critic update (SGD, lr 1, float64) on the fixed batch's values and returns."""
    from megarl.models.build import build_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout
    from megarl.trainer.update import ValueUpdate, update_critic

    tp, pp, vpp, _, cp, pack = layout
    sp = sequence_parallel(dist.get_world_size(), tp)
    built = build_model(
        spec["model"],
        ParallelLayout(tp, pp, vpp, sequence_parallel=sp, context_parallel_size=cp, **(split or {})),
        role="critic",
        dtype=torch.float64, value_head_seed=spec["value_head_seed"],
    )  # fmt: skip
    built.pack = pack
    critic = TrainableModel(
        built,
        OptimizerSettings(
            lr=1.0, optimizer="sgd", weight_decay=0.0, clip_grad=0.0, grad_reduce_in_fp32=False,
            use_distributed_optimizer=False, ddp_bucket_size=BUCKET,
        ),
    )  # fmt: skip
    batch = _rollout(spec)  # with the fixed batch's values and returns
    settings = ValueUpdate(
        responses_per_mini_batch=spec["responses_per_mini_batch"],
        micro_batch_size=spec["micro_batch_size"],
        cliprange_value=spec["cliprange_value"],
    )
    before_head = _hf_weights(critic.chunks, built.dims)["score.weight"]
    metrics = update_critic(critic, batch, settings, seed=0, step=1)
    _enter_weight_read(critic)
    return {"weights": _hf_weights(critic.chunks, built.dims), "metrics": metrics,
            "before_head": before_head}  # fmt: skip


def _bf16_case(spec: dict) -> dict:
    """Two AdamW updates (steps 1 and 2) on the fixed batch in bf16 and in fp32."""
    from megarl.models.build import build_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout
    from megarl.trainer.passes import global_log_probs
    from megarl.trainer.update import PolicyUpdate, update_policy

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        built = build_model(spec["model"], ParallelLayout(), dtype=dtype)
        # lr 1e-6, verl's default actor lr. Larger steps compare bf16's rounding of the model
        # weights, not its arithmetic: at 1e-5 (every AdamW step moves every weight by ~lr,
        # below a bf16 ulp for most of them) fp32's loss moved by 3% in one step while bf16's
        # weights mostly stayed; at 1e-4 the two diverge chaotically (KL to the reference
        # 0.007 -> 2.3).
        actor = TrainableModel(built, OptimizerSettings(lr=1e-6, weight_decay=0.1))
        update = PolicyUpdate(
            responses_per_mini_batch=spec["responses_per_mini_batch"],
            micro_batch_size=spec["micro_batch_size"],
            entropy_coeff=spec["entropy_coeff"],
            use_kl_loss=True,
            kl_loss_coef=spec["kl_loss_coef"],
            temperature=spec["temperature"],
            policy_loss_kwargs=spec["clip"],
        )
        out[name] = []
        if name == "bf16":
            main_weights = _HandAdamW(actor)
        for step in (1, 2):
            batch = _rollout(spec)
            # Positive advantages: with group-normalised (mean-zero) ones the policy loss is a
            # small difference of large terms (measured 0.059 in bf16 vs 0.031 in fp32), which
            # compares rounding noise, not the bf16 path.
            batch.advantages = batch.advantages.abs() + 0.5
            batch.old_log_probs = global_log_probs(
                actor.chunks,
                batch,
                vocab_size=built.dims.vocab_size,
                temperature=spec["temperature"],
                micro_batches=spec["micro_batch_size"],
            )[0]
            metrics = update_policy(
                actor, batch, update, vocab_size=built.dims.vocab_size, seed=0, step=step
            ).metrics
            out[name].append(metrics)
            if name == "bf16" and step == 1:
                out["bf16_step1"] = main_weights.compare()
    return out


class _HandAdamW:
    """Records every optimizer step of a bf16 actor and replays it by hand in float64.

    Starting from the loaded bf16 weights (read before the first step), each step applies
    torch's AdamW formula to the reduced fp32 gradient (clipped as Megatron clips) with the
    group's lr and weight decay. :meth:`compare` returns the largest difference between the
    optimizer's fp32 main weights and that replay, and whether the bf16 model weights are exactly
    the main weights rounded: main weights cloned before the load would start elsewhere.
    """

    def __init__(self, actor) -> None:
        self.actor, self.eps, self.t = actor, actor.settings.eps, 0
        self.pairs = [  # (main fp32 shard, bf16 model parameter, its range in the parameter)
            (main, param, opt._get_model_param_range_map(param)["param"])
            for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
            for mains, params in zip(
                opt.shard_fp32_from_float16_groups, opt.model_float16_groups, strict=True
            )
            for main, param in zip(mains, params, strict=True)
        ]
        self.expected = {
            id(m): p.detach().double().view(-1)[r.start : r.end].clone() for m, p, r in self.pairs
        }
        self.start = {k: v.clone() for k, v in self.expected.items()}
        self.m = {k: torch.zeros_like(v) for k, v in self.expected.items()}
        self.v = {k: torch.zeros_like(v) for k, v in self.expected.items()}
        real_step = actor.step

        def step():
            grads = {
                id(m): p.main_grad.detach().double().view(-1)[r.start : r.end].clone()
                for m, p, r in self.pairs
            }
            result = real_step()
            if result.updated:
                self._replay(grads, result.grad_norm)
            return result

        actor.step = step

    def _replay(self, grads: dict, norm: float) -> None:
        settings = self.actor.settings
        coeff = min(1.0, settings.clip_grad / (norm + 1e-6)) if settings.clip_grad > 0 else 1.0
        (b1, b2), self.t = settings.betas, self.t + 1
        for opt in getattr(self.actor.optimizer, "chained_optimizers", [self.actor.optimizer]):
            for group in opt.optimizer.param_groups:
                lr, wd = group["lr"], group["weight_decay"]
                for main in group["params"]:
                    k = id(main)
                    if k not in grads:
                        continue
                    g = grads[k] * coeff
                    self.m[k] = b1 * self.m[k] + (1 - b1) * g
                    self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
                    denom = (self.v[k] / (1 - b2**self.t)).sqrt() + self.eps
                    self.expected[k] = (
                        self.expected[k] * (1 - lr * wd) - lr / (1 - b1**self.t) * self.m[k] / denom
                    )

    def compare(self) -> dict:
        main_diff, rounded, moved = 0.0, True, 0.0
        for main, param, r in self.pairs:
            expected = self.expected[id(main)]
            # Allowed: one fp32 rounding of the weight per step, and fp32 arithmetic inside
            # AdamW (1e-5 of the update). Reported as a multiple of that allowance.
            ulp = torch.finfo(torch.float32).eps * expected.abs()
            allowed = self.t * ulp + 1e-5 * (expected - self.start[id(main)]).abs() + 1e-30
            main_diff = max(main_diff, float(((main.double() - expected).abs() / allowed).max()))
            model = param.detach().view(-1)[r.start : r.end]
            rounded &= torch.equal(model, main.detach().to(model.dtype))
            moved = max(moved, float((expected - self.start[id(main)]).abs().max()))
        return {
            "main_diff_allowed": main_diff,
            "bf16_is_rounded_main": rounded,
            "steps": self.t,
            "largest_update": moved,
        }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from megarl.parallel.init import destroy_distributed, init_distributed, read_launch_env
    from megarl.parallel.layout import ParallelLayout

    world = read_launch_env().world_size
    results: dict = {}
    for layout in MOE_LAYOUTS.get(world, []):
        tp, pp, vpp, dist_opt, ep, pack = layout
        sp = sequence_parallel(world, tp)
        init_distributed(
            ParallelLayout(
                tp,
                pp,
                vpp,
                sequence_parallel=sp,
                expert_model_parallel_size=ep,
            ),
            seed=1234,
        )
        key = f"moe_tp{tp}_pp{pp}_ep{ep}_dp{world // (tp * pp)}" + ("_distopt" if dist_opt else "")
        key += ("_packed" if pack else "") + ("_sp" if sp else "")
        for case in spec["moe_cases"]:
            if world not in case.get("worlds", (world,)):
                continue
            for optimizer in case["optimizers"]:
                name = f"{key}/{case['name']}/{optimizer}"
                results[name] = _run_case(spec, layout, case, optimizer, spec["moe_model"])
    for layout in LAYOUTS[world]:
        tp, pp, vpp, dist_opt, cp, pack = layout
        sp = sequence_parallel(world, tp)
        init_distributed(
            ParallelLayout(tp, pp, vpp, sequence_parallel=sp, context_parallel_size=cp), seed=1234
        )
        key = layout_key(world, *layout)
        for case in spec["cases"]:
            if vpp and case["dynamic"]:
                continue  # the interleaved schedule needs equal micro-batches: no token budget
            if key not in case.get("layouts", [key]):
                continue
            # SGD always without the distributed optimizer; at (1,1,1) also AdamW in fp32, the
            # like-for-like reference of the distributed optimizer (fp32/bf16 only).
            extra = ("adamw_fp32",) if layout == LAYOUTS[1][0] else ()
            for optimizer in case.get("optimizers", ("sgd", "adamw", *extra)):
                name = f"{key}/{case['name']}/{optimizer}"
                results[name] = _run_case(spec, layout, case, optimizer)
        results[f"{key}/critic"] = _critic_case(spec, layout)
    for layout in UNEVEN_LAYOUTS.get(world, []):
        tp, pp, vpp, dist_opt, cp, pack = layout
        init_distributed(ParallelLayout(tp, pp, vpp, context_parallel_size=cp), seed=1234)
        key, split = layout_key(world, *layout) + "_first1", spec["uneven"]["split"]
        for case in spec["cases"]:
            if case["name"] in spec["uneven"]["cases"]:
                for optimizer in case.get("optimizers", ("sgd", "adamw")):
                    name = f"{key}/{case['name']}/{optimizer}"
                    results[name] = _run_case(spec, layout, case, optimizer, split=split)
        results[f"{key}/critic"] = _critic_case(spec, layout, split)
    if world == 1:
        results["bf16"] = _bf16_case(spec)
    if dist.get_rank() == 0:
        torch.save(results, Path(spec["tmp"]) / f"update_ws{world}.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
