"""Critic values and one critic update at several layouts (one torchrun launch of 2 ranks).

For each case (TP, sequence parallelism, or a Mixture-of-Experts model at EP 1 or 2) the critic is
built from the tiny HF checkpoint, its
values on a fixed batch are computed by the trainer's value pass, and one update by
``update_critic`` with SGD at lr 1 follows, so the weight change is the reduced gradient; the
actor's log-probs and last-position logits on the same batch come along. Rank 0 saves values,
weights before and after (in HF names), log-probs, logits and metrics for pytest:
``python -m torch.distributed.run --nproc_per_node 2 _critic_sp_worker.py SPEC.json``.

Devices: on CPU, gloo with megarl's emulation layer. On a GPU machine with fewer GPUs than
ranks, both ranks share GPU 0 and talk over gloo (NCCL refuses two ranks on one device; gloo
moves CUDA tensors through host memory), which is enough to run TP=2 with sequence parallelism.

On CPU the local layer spec runs sequence parallelism with megarl's marked torch norms
(:class:`megarl.models.gpt.TorchNorm`); everything else — the sequence-sharded embedding output,
the all-gathers and reduce-scatters of the parallel linear layers, the value head's gather — is
Megatron's and megarl's own code too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.trainer._update_worker import _hf_weights, _rollout


def _init_process_group() -> None:
    """gloo when there is no GPU per rank; init_distributed keeps an existing process group."""
    import os
    from datetime import timedelta

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as launch/ sets it for SP on GPU
    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))


def _cpu(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in weights.items()}


def _actor_outputs(spec: dict, layout, batch, pack: bool) -> dict[str, torch.Tensor]:
    """The actor's response log-probs (the trainer's pass) and last-position logits (the actor
    rollout engine's), both of which pad the sequence for sequence parallelism."""
    from megarl.models.build import build_model
    from megarl.rollout.actor_engine import last_position_logits
    from megarl.trainer.passes import global_pass

    dtype = getattr(torch, spec["dtype"])
    built = build_model(
        spec["model"], layout, dtype=dtype, transformer_impl=spec["transformer_impl"]
    )
    vocab = built.dims.vocab_size
    log_probs = global_pass(built.chunks, batch, "actor", micro_batches=spec["micro_batch_size"],
                            vocab_size=vocab, pack=pack)["log_probs"]  # fmt: skip
    if layout.cp > 1:  # the rollout engine's pass runs right-padded rows, which CP cannot split
        return {"log_probs": log_probs.cpu()}
    device = next(built.chunks[0].parameters()).device
    logits = last_position_logits(
        built.chunks, batch.input_ids.to(device), batch.lengths.to(device), vocab
    )
    return {"log_probs": log_probs.cpu(), "last_logits": logits.cpu()}


def _run_case(spec: dict, case: dict) -> dict:
    from megarl.models.build import build_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.trainer.passes import critic_values
    from megarl.trainer.update import ValueUpdate, update_critic

    layout = ParallelLayout(case["tp"], 1, sequence_parallel=case["sequence_parallel"],
                            context_parallel_size=case.get("cp", 1),
                            expert_model_parallel_size=case.get("ep", 1))  # fmt: skip
    init_distributed(layout, seed=1)
    dtype = getattr(torch, spec["dtype"])
    spec = {**spec, "model": spec[case.get("model", "model")]}
    built = build_model(spec["model"], layout, role="critic", dtype=dtype,
                        transformer_impl=spec["transformer_impl"], value_head_seed=7)  # fmt: skip
    built.pack = case.get("pack", False)
    sgd = OptimizerSettings(lr=1.0, optimizer="sgd", weight_decay=0.0, clip_grad=0.0,
                            grad_reduce_in_fp32=False, use_distributed_optimizer=False)  # fmt: skip
    critic = TrainableModel(built, sgd)
    before = _cpu(_hf_weights(critic.chunks, built.dims))
    batch = _rollout(spec)  # tokens, values and returns of the fixed batch
    values = critic_values(critic, batch, micro_batches=spec["micro_batch_size"],
                           max_token_len=None)  # fmt: skip
    settings = ValueUpdate(
        responses_per_mini_batch=len(batch), micro_batch_size=spec["micro_batch_size"],
        cliprange_value=0.5,
    )  # fmt: skip
    metrics = update_critic(critic, batch, settings, seed=0, step=1)
    return {
        **_actor_outputs(spec, layout, batch, built.pack),
        "values": values.cpu(),
        "before": before,
        "after": _cpu(_hf_weights(critic.chunks, built.dims)),
        "metrics": metrics,
        "sequence_parallel": bool(built.config.sequence_parallel),
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    _init_process_group()
    from megarl.parallel.init import destroy_distributed

    results = {case["name"]: _run_case(spec, case) for case in spec["cases"]}
    if dist.get_rank() == 0:
        torch.save(results, spec["out"])
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
