"""One GRPO actor update with LoRA adapters on a fixed batch, at TP 2, PP 2, DP 2 with the
distributed optimizer and TP 2 with sequence parallelism (the local spec, its norms marked as in
``_critic_sp_worker.py``), and the tiny Qwen3-MoE at EP 2 with adapters on attention and every
expert's linears (one 2-rank launch; ``test_lora_update.py`` holds the reference).

The actor is built as the trainer builds it (adapters attached, base frozen, then Megatron DDP
and optimizer) and updated by ``megarl.trainer.update.update_policy``; rank 0 saves the adapters
before and after (full, PEFT names), the base weights after (HF names), the metrics, and the
reference policy's log-probs (the actor's chunks with adapters off, ``BaseModelView``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.trainer._update_worker import _enter_weight_read, _rollout

LAYOUTS = [(2, 1, False, False), (1, 2, False, False), (1, 1, True, False), (2, 1, False, True)]
"""(TP, PP, distributed optimizer, sequence parallelism); DP is what remains of 2 ranks."""
MOE_CASES = [("sgd", False), ("sgd_clip", False), ("adamw", True)]
"""The MoE model at TP 1 × EP 2 (DP 2, expert-DP 1: each rank the adapters of its 4 experts):
(optimizer, distributed optimizer). ``sgd_clip``: SGD whose clipping bites (the grad norm, each
expert adapter counted once, scales the step)."""


def _adapters_as_peft(chunks, dims) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state

    from megarl.models.lora_peft import adapters_to_hf, full_adapters

    mine = {k: (a.double(), b.double()) for k, (a, b) in full_adapters(chunks).items()}
    boxes: list = [None] * dist.get_world_size()
    keep = parallel_state.get_tensor_model_parallel_rank() == 0
    dist.all_gather_object(boxes, mine if keep else {})
    merged: dict = {}
    for b in boxes:
        merged.update(b)
    return adapters_to_hf(merged, dims)


def _base_weights(chunks, dims) -> dict[str, torch.Tensor]:
    """The base weights (adapters not merged), TP-merged, HF names, gathered to every rank."""
    from megarl.models.weights import holds_first_copy, iter_full_hf_tensors

    local = {n: t.detach().float().clone() for n, t, expert in iter_full_hf_tensors(
        chunks, dims, with_expert_flag=True, merge_adapters=False) if holds_first_copy(expert)}  # fmt: skip
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, local)
    return {k: v for box in boxes for k, v in box.items()}


def _case(
    spec: dict, tp: int, pp: int, dist_opt: bool, sp: bool, optimizer: str, *, ep: int = 1
) -> dict:
    from megarl.models.build import build_model
    from megarl.models.gpt import unwrap
    from megarl.models.lora import BaseModelView, LoraSettings, attach_adapters, freeze_base
    from megarl.models.trainable import OptimizerSettings, TrainableModel, _leaf_optimizers
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.trainer.passes import global_log_probs
    from megarl.trainer.update import PolicyUpdate, update_policy

    layout = ParallelLayout(tp, pp, None, sequence_parallel=sp, expert_model_parallel_size=ep)
    init_distributed(layout, seed=1234)
    dtype = torch.float32 if dist_opt else torch.float64  # Megatron's dist. optimizer: fp32/bf16
    built = build_model(spec["moe_model"] if ep > 1 else spec["model"], layout, dtype=dtype)
    assert all(bool(unwrap(c).config.sequence_parallel) == sp for c in built.chunks)
    attach_adapters(built.chunks, LoraSettings(**spec["lora"]), allow_experts=ep > 1)
    freeze_base(built.chunks)
    before = _adapters_as_peft(built.chunks, built.dims)
    if optimizer.startswith("sgd"):
        clip = spec["sgd_clip"] if optimizer == "sgd_clip" else 0.0
        settings = OptimizerSettings(lr=spec["sgd_lr"], optimizer="sgd", weight_decay=0.0,
                                     clip_grad=clip, use_distributed_optimizer=False,
                                     grad_reduce_in_fp32=False)  # fmt: skip
    else:
        settings = OptimizerSettings(lr=1e-3, weight_decay=0.1, eps=spec["adam_eps"],
                                     clip_grad=1.0, grad_reduce_in_fp32=dtype != torch.float64,
                                     use_distributed_optimizer=dist_opt)  # fmt: skip
    actor = TrainableModel(built, settings)
    trainable = sum(p.numel() for c in actor.chunks for p in c.parameters() if p.requires_grad)
    # what the optimizer steps: every parameter of its groups (main copies of this rank's shard)
    stepped = sum(p.numel() for o in _leaf_optimizers(actor.optimizer)
                  for g in o.param_groups for p in g["params"])  # fmt: skip
    batch = _rollout(spec)
    ref = BaseModelView(actor)
    ref_lp, _, _ = global_log_probs(ref.chunks, batch, vocab_size=built.dims.vocab_size,
                                    temperature=spec["temperature"], micro_batches=4,
                                    max_token_len=None, pack=ref.pack)  # fmt: skip
    update = PolicyUpdate(
        responses_per_mini_batch=spec["responses_per_mini_batch"],
        micro_batch_size=spec["micro_batch_size"],
        max_token_len=None,
        loss_agg_mode="token-mean",
        entropy_coeff=spec["entropy_coeff"],
        use_kl_loss=True,
        kl_loss_coef=spec["kl_loss_coef"],
        kl_loss_type="low_var_kl",
        temperature=spec["temperature"],
        policy_loss_kwargs=spec["clip"],
    )
    metrics = update_policy(actor, batch, update, vocab_size=built.dims.vocab_size, seed=0,
                            step=1).metrics  # fmt: skip
    _enter_weight_read(actor)
    return {
        "dtype": str(dtype),
        "before": before,
        "after": _adapters_as_peft(actor.chunks, built.dims),
        "base": _base_weights(actor.chunks, built.dims),
        "metrics": metrics,
        "ref_log_probs": ref_lp,
        "trainable_local": trainable,
        "optimizer_numel": stepped,
        "base_numel_local": sum(p.numel() for c in actor.chunks for p in c.parameters())
        - trainable,
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from megarl.parallel.init import destroy_distributed
    from tests.trainer._critic_sp_worker import _emulate_sp_norm

    _emulate_sp_norm()  # (acts only on models built with sequence parallelism)
    results: dict = {}
    for tp, pp, dist_opt, sp in LAYOUTS:
        key = f"tp{tp}_pp{pp}" + ("_dp2_distopt" if dist_opt else "") + ("_sp" if sp else "")
        for optimizer in ("adamw",) if dist_opt else ("sgd",) if sp else ("sgd", "adamw"):
            results[f"{key}/{optimizer}"] = _case(spec, tp, pp, dist_opt, sp, optimizer)
    for optimizer, dist_opt in MOE_CASES:
        key = "moe_tp1_ep2" + ("_distopt" if dist_opt else "")
        results[f"{key}/{optimizer}"] = _case(spec, 1, 1, dist_opt, False, optimizer, ep=2)
    if dist.get_rank() == 0:
        torch.save(results, Path(spec["tmp"]) / "lora_update.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
