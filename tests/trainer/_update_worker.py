"""One actor update on a fixed batch at every layout of one world size (one torchrun launch).

For each layout and case the actor is built from the tiny HF checkpoint, updated once by
``megarl.trainer.actor.update_policy`` (the product's code path) and its weights are gathered in
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
    1: [(1, 1, None, False)],
    2: [(2, 1, None, False), (1, 2, None, False), (1, 1, None, False), (1, 2, 2, False)],
    4: [(2, 1, None, True), (2, 2, None, False)],
}
"""(TP, PP, VPP, distributed optimizer) per world size; DP is what remains."""


def _hf_weights(chunks, dims) -> dict[str, torch.Tensor]:
    """Every parameter, TP-merged, in HF names, on every rank."""
    from megatron.core import parallel_state

    from megarl.models import hf_mapping as hm
    from megarl.models.gpt import ValueHead, unwrap
    from megarl.models.weights import gather_tp, local_global_names

    local: dict[str, torch.Tensor] = {}
    for i, _, global_name, param in local_global_names(chunks):
        if global_name == hm.OUTPUT_LAYER and isinstance(unwrap(chunks[i]).output_layer, ValueHead):
            local["score.weight"] = param.detach().float().clone()
            continue
        full = gather_tp(global_name, param.detach().float(), dims)
        local.update(
            {k: v.clone() for k, v in hm.megatron_param_to_hf(global_name, full, dims).items()}
        )
    first_replica = (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, local if first_replica else {})
    merged: dict[str, torch.Tensor] = {}
    for box in boxes:
        merged.update(box)
    return merged


def _replicas_identical(chunks) -> bool:
    """All DP replicas hold bit-identical parameters (compared by a float64 checksum per tensor)."""
    from megatron.core import parallel_state

    from megarl.models.weights import local_global_names

    sums = torch.tensor(
        [float(p.detach().double().sum()) for *_, p in local_global_names(chunks)],
        dtype=torch.float64,
    )
    group = parallel_state.get_data_parallel_group()
    parts = [torch.empty_like(sums) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, sums, group=group)
    return all(torch.equal(parts[0], p) for p in parts)


def _rollout(spec: dict):
    from megarl.trainer.batch import rollout_tensors

    data = torch.load(spec["batch"])
    batch = rollout_tensors(
        data["prompts"],
        data["responses"],
        [[0.0] * len(r) for r in data["responses"]],
        data["prompt_ids"],
        [False] * len(data["responses"]),
        pad_token_id=0,
    )
    for name in ("advantages", "old_log_probs", "ref_log_probs", "values", "returns"):
        if name in data:
            batch.fields[name] = data[name]
    return batch


def _run_case(spec: dict, layout, case: dict, optimizer: str) -> dict:
    from megarl.models.build import build_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout
    from megarl.trainer.actor import PolicyUpdate, update_policy

    tp, pp, vpp, dist_opt = layout
    # float64 wherever Megatron allows it (its distributed optimizer takes fp32/bf16 only), so
    # that the comparison measures the parallel arithmetic, not fp32 rounding.
    exact = optimizer != "adamw_fp32" and not (optimizer == "adamw" and dist_opt)
    dtype = torch.float64 if exact else torch.float32
    built = build_model(spec["model"], ParallelLayout(tp, pp, vpp), dtype=dtype)
    if optimizer == "sgd":
        settings = OptimizerSettings(
            lr=1.0,
            optimizer="sgd",
            weight_decay=0.0,
            clip_grad=0.0,
            grad_reduce_in_fp32=False,
            use_distributed_optimizer=False,
        )
    else:
        settings = OptimizerSettings(
            lr=1e-3,
            weight_decay=0.1,
            eps=spec["adam_eps"],
            clip_grad=1.0,
            grad_reduce_in_fp32=not exact,
            use_distributed_optimizer=dist_opt,
        )
    actor = TrainableModel(built, settings)
    update = PolicyUpdate(
        responses_per_mini_batch=spec["responses_per_mini_batch"],
        micro_batch_size=None if case["dynamic"] else spec["micro_batch_size"],
        max_token_len=spec["max_token_len"] if case["dynamic"] else None,
        loss_agg_mode=case["loss_agg_mode"],
        entropy_coeff=spec["entropy_coeff"],
        use_kl_loss=True,
        kl_loss_coef=spec["kl_loss_coef"],
        kl_loss_type="low_var_kl",
        temperature=spec["temperature"],
        balance=case["dynamic"],  # token-balanced DP shares in the dynamic case
        policy_loss_kwargs=spec["clip"],
    )
    metrics = update_policy(
        actor, _rollout(spec), update, vocab_size=built.dims.vocab_size, seed=0, step=1
    )
    return {
        "dtype": str(dtype),
        "weights": _hf_weights(actor.chunks, built.dims),
        "metrics": metrics,
        "replicas_identical": _replicas_identical(actor.chunks),
    }


def _critic_case(spec: dict, layout) -> dict:
    """One critic update (SGD, lr 1, float64) on the fixed batch's values and returns."""
    from megarl.models.build import build_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout
    from megarl.trainer.critic import ValueUpdate, update_critic

    tp, pp, vpp, _ = layout
    built = build_model(
        spec["model"], ParallelLayout(tp, pp, vpp), role="critic", dtype=torch.float64,
        value_head_seed=spec["value_head_seed"],
    )  # fmt: skip
    critic = TrainableModel(
        built,
        OptimizerSettings(
            lr=1.0, optimizer="sgd", weight_decay=0.0, clip_grad=0.0, grad_reduce_in_fp32=False,
            use_distributed_optimizer=False,
        ),
    )  # fmt: skip
    batch = _rollout(spec)  # with the fixed batch's values and returns
    settings = ValueUpdate(
        responses_per_mini_batch=spec["responses_per_mini_batch"],
        micro_batch_size=spec["micro_batch_size"],
        cliprange_value=spec["cliprange_value"],
    )
    metrics = update_critic(critic, batch, settings, seed=0, step=1)
    return {"weights": _hf_weights(critic.chunks, built.dims), "metrics": metrics}


def _bf16_case(spec: dict) -> dict:
    """Two AdamW updates (steps 1 and 2) on the fixed batch in bf16 and in fp32."""
    from megarl.models.build import build_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout
    from megarl.trainer.actor import PolicyUpdate, update_policy
    from megarl.trainer.passes import global_log_probs

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        built = build_model(spec["model"], ParallelLayout(), dtype=dtype)
        # lr 1e-5: at 1e-4 one AdamW step moves this tiny model so far (KL to the reference
        # 0.007 -> 2.3) that fp32 and bf16 diverge chaotically, which says nothing about bf16.
        actor = TrainableModel(built, OptimizerSettings(lr=1e-5, weight_decay=0.1))
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
        for step in (1, 2):
            batch = _rollout(spec)
            batch.fields["old_log_probs"] = global_log_probs(
                actor.chunks,
                batch,
                vocab_size=built.dims.vocab_size,
                temperature=spec["temperature"],
                micro_batches=spec["micro_batch_size"],
            )[0]
            metrics = update_policy(
                actor, batch, update, vocab_size=built.dims.vocab_size, seed=0, step=step
            )
            out[name].append(metrics)
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from megarl.parallel.init import destroy_distributed, init_distributed, read_launch_env
    from megarl.parallel.layout import ParallelLayout

    world = read_launch_env().world_size
    results: dict = {}
    for layout in LAYOUTS[world]:
        tp, pp, vpp, dist_opt = layout
        init_distributed(ParallelLayout(tp, pp, vpp), seed=1234)
        key = f"tp{tp}_pp{pp}_vpp{vpp or 1}_dp{world // (tp * pp)}" + (
            "_distopt" if dist_opt else ""
        )
        for case in spec["cases"]:
            if vpp and case["dynamic"]:
                continue  # the interleaved schedule needs equal micro-batches: no token budget
            # SGD always without the distributed optimizer; at (1,1,1) also AdamW in fp32, the
            # like-for-like reference of the distributed optimizer (fp32/bf16 only).
            extra = ("adamw_fp32",) if layout == (1, 1, None, False) else ()
            for optimizer in ("sgd", "adamw", *extra):
                name = f"{key}/{case['name']}/{optimizer}"
                results[name] = _run_case(spec, layout, case, optimizer)
        results[f"{key}/critic"] = _critic_case(spec, layout)
    if world == 1:
        results["bf16"] = _bf16_case(spec)
    if dist.get_rank() == 0:
        torch.save(results, Path(spec["tmp"]) / f"update_ws{world}.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
