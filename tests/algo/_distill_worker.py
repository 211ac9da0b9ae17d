"""Two gloo ranks (torchrun): the distillation losses from TP-2 vocab-parallel student logits
vs a dense single-process float64 reference computed on every rank; writes max differences.

Usage: torchrun --nproc_per_node 2 _distill_worker.py OUT.json
Pure torch (no Megatron): the TP group is the world.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from megarl.algo.distillation import distillation_loss, distillation_token_losses
from megarl.models.logprobs import vocab_parallel_log_probs_and_entropy
from megarl.models.topk_logprobs import vocab_parallel_log_probs_at

VOCAB, PADDED, B, T, K = 50, 64, 3, 6, 8
CASES = {
    # name: (loss_mode, log_prob_min_clamp, loss_max_clamp, loss_agg_mode, temperature)
    "forward_kl_topk": ("forward_kl_topk", None, None, "token-mean", 1.0),
    "forward_kl_topk/clamped": ("forward_kl_topk", -8.0, 6.0, "seq-mean-token-mean", 0.7),
    "k3": ("k3", None, None, "token-mean", 1.0),
    "k1/clamped": ("k1", None, 5.0, "seq-mean-token-sum", 0.7),
    "k2": ("k2", None, None, "token-sum", 1.0),
}


def inputs() -> dict[str, torch.Tensor]:
    """The same float64 batch on every rank (seeded)."""
    g = torch.Generator().manual_seed(57)
    student = 3 * torch.randn(B, T, PADDED, generator=g, dtype=torch.float64)
    student[..., VOCAB:] = 1e4  # padding columns: must never count
    teacher = torch.log_softmax(3 * torch.randn(B, T, VOCAB, generator=g, dtype=torch.float64), -1)
    top = teacher.topk(K, dim=-1)
    sampled = torch.randint(0, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 4:] = 0
    mask[2, 1] = 0
    return {
        "student": student,
        "teacher_topk_ids": top.indices,
        "teacher_topk_log_probs": top.values,
        "sampled": sampled,
        "teacher_sampled": teacher.gather(-1, sampled[..., None]).squeeze(-1),
        "mask": mask,
    }


def loss_of(case: tuple, x: dict, topk: torch.Tensor | None, sampled: torch.Tensor | None):
    mode, floor, cap, agg, _ = case
    token = distillation_token_losses(
        mode,
        student_log_probs=sampled,
        teacher_log_probs=x["teacher_sampled"],
        student_topk_log_probs=topk,
        teacher_topk_log_probs=x["teacher_topk_log_probs"],
        log_prob_min_clamp=floor,
        loss_max_clamp=cap,
    )
    return distillation_loss(token, x["mask"], agg)


def parallel(case: tuple, x: dict, rank: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and this rank's logit gradient from its vocabulary shard (group None: unreduced)."""
    width = PADDED // 2
    shard = x["student"][..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
    common = {
        "vocab_size": VOCAB,
        "temperature": case[4],
        "vocab_start": rank * width,
        "group": group,
    }
    if case[0] == "forward_kl_topk":
        topk = vocab_parallel_log_probs_at(shard, x["teacher_topk_ids"], chunk=4, **common)
        loss = loss_of(case, x, topk, None)
    else:
        sampled, _ = vocab_parallel_log_probs_and_entropy(shard, x["sampled"], chunk=4, **common)
        loss = loss_of(case, x, None, sampled)
    loss.backward()
    return loss.detach(), shard.grad


def dense(case: tuple, x: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The single-process reference: log_softmax over the trimmed vocabulary, float64."""
    full = x["student"][..., :VOCAB].clone().requires_grad_(True)
    log_p = torch.log_softmax(full / case[4], dim=-1)
    if case[0] == "forward_kl_topk":
        loss = loss_of(case, x, log_p.gather(-1, x["teacher_topk_ids"]), None)
    else:
        loss = loss_of(case, x, None, log_p.gather(-1, x["sampled"][..., None]).squeeze(-1))
    loss.backward()
    grad = torch.cat([full.grad, torch.zeros(B, T, PADDED - VOCAB, dtype=full.dtype)], dim=-1)
    width = PADDED // 2
    return loss.detach(), grad[..., rank * width : (rank + 1) * width]


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = inputs()
    results = {}
    for name, case in CASES.items():
        ref_loss, ref_grad = dense(case, x, rank)
        loss, grad = parallel(case, x, rank, dist.group.WORLD)
        bad_loss, bad_grad = parallel(case, x, rank, None)  # the TP reduction left out
        results[name] = {
            "loss": max_over_ranks((loss - ref_loss).abs().item()),
            "grad": max_over_ranks((grad - ref_grad).abs().max().item()),
            "grad_scale": max_over_ranks(ref_grad.abs().max().item()),
            "loss_value": ref_loss.item(),
            "unreduced": max_over_ranks(
                max((bad_loss - ref_loss).abs().item(), (bad_grad - ref_grad).abs().max().item())
            ),
        }
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
