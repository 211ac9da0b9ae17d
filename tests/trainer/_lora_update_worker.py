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
(optimizer, distributed optimizer); then SGD at TP 2 × EP 2 with sequence parallelism and
at PP 2 (EP 1). ``sgd_clip``: SGD whose clipping bites (the grad norm, each
expert adapter counted once, scales the step)."""


def _adapters_as_peft(chunks, dims) -> dict[str, torch.Tensor]:
    from megarl.models import moe_mapping as mm
    from megarl.models.lora_peft import adapters_to_hf, full_adapters
    from megarl.models.weights import holds_first_copy

    mine = {k: (a.double(), b.double()) for k, (a, b) in full_adapters(chunks).items()
            if holds_first_copy(mm.is_expert_param(k))}  # fmt: skip
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, mine)
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


def _policy_update(spec: dict):
    from megarl.trainer.update import PolicyUpdate

    return PolicyUpdate(
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


def _actor(
    spec: dict, layout, dist_opt: bool, optimizer: str, *, seed_shift: int = 0, moe: bool = False
):
    """(built model, optimizer settings) as the trainer builds a LoRA actor: adapters (seeded
    ``seed + seed_shift``) on the tiny Qwen2 or (``moe``, or EP > 1) Qwen3-MoE, base frozen."""
    from dataclasses import replace

    from megarl.models.build import build_model
    from megarl.models.lora import LoraSettings, attach_adapters, freeze_base
    from megarl.models.trainable import OptimizerSettings
    from megarl.parallel.init import init_distributed

    init_distributed(layout, seed=1234)
    ep = layout.expert_model_parallel_size
    dtype = torch.float32 if dist_opt else torch.float64  # Megatron's dist. optimizer: fp32/bf16
    built = build_model(spec["moe_model"] if moe or ep > 1 else spec["model"], layout, dtype=dtype)
    lora = LoraSettings(**spec["lora"])
    attach_adapters(built.chunks, replace(lora, seed=lora.seed + seed_shift))
    freeze_base(built.chunks)
    built.meta["lora"] = lora
    if optimizer.startswith("sgd"):
        clip = spec["sgd_clip"] if optimizer == "sgd_clip" else 0.0
        settings = OptimizerSettings(lr=spec["sgd_lr"], optimizer="sgd", weight_decay=0.0,
                                     clip_grad=clip, use_distributed_optimizer=False,
                                     grad_reduce_in_fp32=False)  # fmt: skip
    else:
        settings = OptimizerSettings(lr=1e-3, weight_decay=0.1, eps=spec["adam_eps"],
                                     clip_grad=1.0, grad_reduce_in_fp32=dtype != torch.float64,
                                     use_distributed_optimizer=dist_opt)  # fmt: skip
    return built, settings


def _case(
    spec: dict,
    tp: int,
    pp: int,
    dist_opt: bool,
    sp: bool,
    optimizer: str,
    *,
    ep: int = 1,
    moe: bool = False,
    checkpoint: Path | None = None,
) -> dict:
    from megarl.models.gpt import unwrap
    from megarl.models.lora import BaseModelView
    from megarl.models.trainable import TrainableModel, _leaf_optimizers
    from megarl.parallel.layout import ParallelLayout
    from megarl.trainer.passes import global_log_probs
    from megarl.trainer.update import update_policy

    layout = ParallelLayout(tp, pp, None, sequence_parallel=sp, expert_model_parallel_size=ep,
                            expert_tensor_parallel_size=1 if ep > 1 else None)  # fmt: skip
    built, settings = _actor(spec, layout, dist_opt, optimizer, moe=moe)
    dtype = built.config.params_dtype
    assert all(bool(unwrap(c).config.sequence_parallel) == sp for c in built.chunks)
    before = _adapters_as_peft(built.chunks, built.dims)
    actor = TrainableModel(built, settings)
    trainable = sum(p.numel() for c in actor.chunks for p in c.parameters() if p.requires_grad)
    # what the optimizer steps: every parameter of its groups (main copies of this rank's shard)
    stepped = sum(p.numel() for o in _leaf_optimizers(actor.optimizer)
                  for g in o.param_groups for p in g["params"])  # fmt: skip
    batch = _rollout(spec)
    probe = _dropout_probe(spec, actor, batch) if sp else {}
    ref = BaseModelView(actor)
    ref_lp, _, _ = global_log_probs(ref.chunks, batch, vocab_size=built.dims.vocab_size,
                                    temperature=spec["temperature"], micro_batches=4,
                                    max_token_len=None, pack=ref.pack)  # fmt: skip
    metrics = update_policy(actor, batch, _policy_update(spec), vocab_size=built.dims.vocab_size,
                            seed=0, step=1).metrics  # fmt: skip
    _enter_weight_read(actor)
    out = {
        "dtype": str(dtype),
        "before": before,
        "after": _adapters_as_peft(actor.chunks, built.dims),
        "base": _base_weights(actor.chunks, built.dims),
        "metrics": metrics,
        "ref_log_probs": ref_lp,
        **probe,
        "trainable_local": trainable,
        "optimizer_numel": stepped,
        "base_numel_local": sum(p.numel() for c in actor.chunks for p in c.parameters())
        - trainable,
    }
    if checkpoint is not None:  # the trainer's save (adapters, optimizer, PEFT + merged HF)
        from megarl.checkpoint.trainer_ckpt import SavedModel, save_checkpoint

        saved = SavedModel("actor", actor, "actor_rollout_ref.actor",
                           "actor_rollout_ref.model.path", spec["moe_model"])  # fmt: skip
        save_checkpoint(checkpoint, 1, [saved], trainer_state={"step": 1}, config_yaml="",
                        keep={"actor": None}, export_hf_model=True)  # fmt: skip
        out["after_step2"] = _second_step(spec, actor, built)
    return out


def _dropout_probe(spec: dict, actor, batch) -> dict:
    """With ``lora.dropout`` 0.5 (sequence parallelism on): the actor's forward-only log-probs
    (the old-log-prob pass) twice and without dropout, whether the chunks are back in train mode
    afterwards, and whether an adapter in train mode does drop (two calls differ). Dropout is
    set back to 0 before the update."""
    from megarl.models.lora import adapted_linears
    from megarl.trainer.passes import global_log_probs

    adapters = [lin.lora for _, _, lin in adapted_linears(actor.chunks)]

    def log_probs():
        return global_log_probs(actor.chunks, batch, vocab_size=actor.model.dims.vocab_size,
                                temperature=spec["temperature"], micro_batches=4,
                                max_token_len=None, pack=actor.model.pack)[0]  # fmt: skip

    for a in adapters:
        a.dropout = 0.5
    dropped = [log_probs(), log_probs()]
    x = torch.ones(4, adapters[0].A.shape[1], dtype=adapters[0].A.dtype)
    train_mode_drops = not torch.equal(adapters[0](x), adapters[0](x))
    for a in adapters:
        a.dropout = 0.0
    plain = log_probs()
    return {
        "dropout_forward_only_diff": max(float((d - plain).abs().max()) for d in dropped),
        "dropout_train_mode_drops": train_mode_drops,
        "chunks_back_in_train_mode": all(c.training for c in actor.chunks),
    }


def _second_step(spec: dict, actor, built) -> dict:
    from megarl.trainer.update import update_policy

    update_policy(actor, _rollout(spec), _policy_update(spec), vocab_size=built.dims.vocab_size,
                  seed=0, step=2)  # fmt: skip
    _enter_weight_read(actor)
    return _adapters_as_peft(actor.chunks, built.dims)


def _resumed(spec: dict, ep: int, ckpt: Path) -> dict:
    """A fresh MoE actor at EP ``ep`` (adapters of another seed) loads the step-1 checkpoint
    (adapters and optimizer state) and takes step 2; and ``lora.adapter_path``: the checkpoint's
    PEFT export loaded into a fresh model's adapters (a third seed)."""
    from megarl.checkpoint.trainer_ckpt import SavedModel, load_checkpoint
    from megarl.models.lora_peft import load_peft_adapter
    from megarl.models.trainable import TrainableModel
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout(1, 1, None, expert_model_parallel_size=ep)
    built, settings = _actor(spec, layout, True, "adamw", seed_shift=1, moe=True)
    actor = TrainableModel(built, settings)
    saved = SavedModel("actor", actor, "actor_rollout_ref.actor", "actor_rollout_ref.model.path",
                       spec["moe_model"])  # fmt: skip
    load_checkpoint(ckpt, [saved], lambda message: print(message))
    out = {"loaded": _adapters_as_peft(actor.chunks, built.dims)}
    out["after_step2"] = _second_step(spec, actor, built)
    other, _ = _actor(spec, layout, True, "adamw", seed_shift=2, moe=True)
    n = load_peft_adapter(other.chunks, other.dims, built.meta["lora"],
                          ckpt / "actor" / "lora_adapter")  # fmt: skip
    out["from_peft"], out["from_peft_count"] = _adapters_as_peft(other.chunks, other.dims), n
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from megarl.parallel.init import destroy_distributed

    results: dict = {}
    for tp, pp, dist_opt, sp in LAYOUTS:
        key = f"tp{tp}_pp{pp}" + ("_dp2_distopt" if dist_opt else "") + ("_sp" if sp else "")
        for optimizer in ("adamw",) if dist_opt else ("sgd",) if sp else ("sgd", "adamw"):
            results[f"{key}/{optimizer}"] = _case(spec, tp, pp, dist_opt, sp, optimizer)
    run_dir = Path(spec["tmp"]) / "moe_lora_run"
    for optimizer, dist_opt in MOE_CASES:
        key = "moe_tp1_ep2" + ("_distopt" if dist_opt else "")
        saves = run_dir if dist_opt else None
        results[f"{key}/{optimizer}"] = _case(spec, 1, 1, dist_opt, False, optimizer, ep=2,
                                              checkpoint=saves)  # fmt: skip
    # TP 2 × EP 2 (expert TP 1) with sequence parallelism, as MoE trains at TP > 1
    results["moe_tp2_ep2_sp/sgd"] = _case(spec, 2, 1, False, True, "sgd", ep=2)
    results["moe_tp1_pp2/sgd"] = _case(spec, 1, 2, False, False, "sgd", moe=True)  # (EP 1)
    for ep in (2, 1):  # resume at the saved layout, and at EP 1 (expert-DP 2)
        results[f"moe_resumed_ep{ep}"] = _resumed(spec, ep, run_dir / "global_step_1")
    if dist.get_rank() == 0:
        torch.save(results, Path(spec["tmp"]) / "lora_update.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
