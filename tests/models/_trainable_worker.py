"""Multi-rank checks of the trainable-model API and the runner's loss contract (one launch).

Layout TP=1, PP=1, DP=2: every rank holds the whole model, so the single-process reference (a
plain forward/backward of the full batch, no schedule, no DDP) is computed on each rank locally.
Rank 0 writes a dict of results for the pytest side:
``python -m torch.distributed.run --nproc_per_node 2 _trainable_worker.py SPEC.json``.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _token_loss(
    logp: torch.Tensor, ent: torch.Tensor, w: torch.Tensor, weight: float
) -> torch.Tensor:
    """A per-token loss using both actor outputs: weight·(-w·log p - 0.1·entropy)."""
    return weight * (-(w * logp) - 0.1 * ent)


def _full_batch_reference(
    chunks, batch: dict, mode: str, vocab: int, weight: float
) -> dict[str, torch.Tensor]:
    """Gradients of agg_loss over the whole batch: direct forward of the plain model, autograd."""
    from megarl.algo import agg_loss
    from megarl.models.runner import causal_mask, response_mask

    model = chunks[0]
    ids, plen, lens = batch["input_ids"], batch["prompt_lengths"], batch["lengths"]
    seq = ids.shape[1]
    logits = model(ids, torch.arange(seq)[None].expand_as(ids), causal_mask(seq, ids.device))
    logits = logits[..., :vocab].double()
    logp_all = torch.log_softmax(logits, dim=-1)
    ent_all = -(logp_all.exp() * logp_all).sum(-1)
    tok_logp = logp_all[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    r = int((lens - plen).max())
    k = torch.arange(r)[None]
    idx = (plen[:, None] - 1 + k).clamp(max=seq - 2)
    logp, ent = tok_logp.gather(1, idx), ent_all[:, :-1].gather(1, idx)
    mask = response_mask(plen, lens)
    token_loss = _token_loss(logp, ent, batch["w"], weight)
    loss = agg_loss(token_loss, mask, mode, loss_scale_factor=7.0)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def _shard(batch: dict, rank: int, world: int) -> dict:
    n = batch["input_ids"].shape[0] // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def _params(model) -> dict[str, torch.Tensor]:
    """Every parameter of chunk 0 (of a TrainableModel: made current first, as every reader of
    weights outside a forward must with ``overlap_param_gather``)."""
    from megarl.models.gpt import unwrap

    if hasattr(model, "finish_param_sync"):
        model.finish_param_sync()
        model = model.chunks
    return {n: p.detach().double().clone() for n, p in unwrap(model[0]).named_parameters()}


OVERLAP_KEYS = ("overlap_grad_reduce", "overlap_param_gather", "use_distributed_optimizer")


def _overlap_record(trainable) -> dict:
    """Wrap the DDP bucket groups to record how Megatron ran the overlaps: whether each gradient
    reduce was already in flight (launched from the backward pass) when the step's
    ``finish_grad_sync`` came, and whether the parameter all-gather was still deferred after the
    optimizer step."""
    record: dict = {"reduce_in_flight": [], "gather_deferred": []}
    groups = [g for c in trainable.chunks for g in c.bucket_groups]
    for group in groups:
        finish = group.finish_grad_sync

        def finish_grad_sync(*args, group=group, finish=finish, **kwargs):
            record["reduce_in_flight"].append(group.grad_reduce_handle is not None)
            return finish(*args, **kwargs)

        group.finish_grad_sync = finish_grad_sync
    step = trainable.step

    def recorded_step():
        result = step()
        record["gather_deferred"].append(all(not g.param_gather_dispatched for g in groups))
        return result

    trainable.step = recorded_step
    return record


def _train_once(
    trainable, batch: dict, mode: str, vocab: int, *, poison: bool = False, weight: float = 1.0
):
    """One mini-batch (this rank's DP shard, 2 micro-batches) through forward_backward + step."""
    from megarl.algo import agg_loss, count_tokens_and_seqs
    from megarl.models.runner import SequenceBatch, forward_backward, response_mask

    full_mask = response_mask(batch["prompt_lengths"], batch["lengths"])
    tokens, seqs = count_tokens_and_seqs(full_mask)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _shard(batch, rank, world)

    def loss_fn(outputs, mb):
        width = outputs["log_probs"].shape[1]
        mask = torch.arange(width)[None] < (mb["lengths"] - mb["prompt_lengths"])[:, None]
        w = mb["w"][:, :width]
        loss = agg_loss(
            _token_loss(outputs["log_probs"], outputs["entropy"], w, weight),
            mask,
            mode,
            global_token_count=tokens,
            global_seq_count=seqs,
            loss_scale_factor=7.0,
        )
        if poison and rank == 1:
            loss = loss * float("nan")
        return loss, {"loss": loss.detach()}

    sequences = SequenceBatch(
        mine["input_ids"], mine["prompt_lengths"], mine["lengths"], extra={"w": mine["w"]}
    )
    metrics = forward_backward(
        trainable.chunks, sequences, loss_fn, micro_batches=2, vocab_size=vocab
    )
    hook = getattr(trainable, "after_backward", None)
    if hook is not None:
        hook()
    return trainable.step(), metrics


def _replicas_identical(params: dict[str, torch.Tensor]) -> bool:
    """Both DP ranks hold bit-identical parameters."""
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    other = flat.clone()
    dist.broadcast(other, src=0)
    same = torch.tensor([float(torch.equal(flat, other))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def _owned_grad_diff(trainable, ref_grads: dict[str, torch.Tensor]) -> tuple[float, bool]:
    """Distributed optimizer: largest difference between each rank's owned shard of the reduced
    gradient (exact after the reduce-scatter) and the reference; and whether the ranks' shards
    together cover every parameter element once."""
    from megarl.models.gpt import unwrap

    names = {p: n for n, p in unwrap(trainable.chunks[0]).named_parameters()}
    diff, owned = 0.0, 0
    for opt in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
        for param, name in names.items():
            if param not in opt.model_param_gbuf_map:
                continue
            span = opt._get_model_param_range_map(param)["param"]
            mine = param.main_grad.view(-1)[span.start : span.end].double()
            ref = ref_grads[name].reshape(-1)[span.start : span.end]
            if mine.numel():
                diff = max(diff, float((mine - ref).abs().max()))
            owned += mine.numel()
    total = torch.tensor([owned])
    dist.all_reduce(total)
    return diff, int(total.item()) == sum(g.numel() for g in ref_grads.values())


def _contract_checks(spec: dict, results: dict) -> None:
    from megarl.models.build import build_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout

    batch = torch.load(spec["batch"])
    layout = ParallelLayout()
    # Plain DDP: one SGD step with lr 1, so the weight change is the reduced gradient, in float64
    # throughout (gradient buffers too), so that 1e-6 measures the scaling contract and not fp32
    # summation order. The distributed optimizer supports only Adam and fp32/bf16 parameters:
    # compare its owned gradient shards, in fp32, with a float64 reference. fp32 rounding is
    # relative (~5e-7 of the largest entry, measured), so that side scales the loss by 1/4 (largest
    # gradient entry ~0.6) where 1e-6 absolute holds with margin.
    weights = {False: 1.0, True: 0.25}
    settings = {
        False: OptimizerSettings(
            lr=1.0,
            optimizer="sgd",
            weight_decay=0.0,
            clip_grad=0.0,
            grad_reduce_in_fp32=False,
            use_distributed_optimizer=False,
        ),
        True: OptimizerSettings(lr=0.0, clip_grad=0.0, use_distributed_optimizer=True),
    }
    dtypes = {False: torch.float64, True: torch.float32}
    for dist_opt in (False, True):
        for mode in AGG_MODES:
            reference = build_model(spec["model"], layout, dtype=torch.float64)
            vocab = reference.dims.vocab_size
            ref_grads = _full_batch_reference(
                reference.chunks, batch, mode, vocab, weights[dist_opt]
            )
            ref_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in ref_grads.values()))
            built = build_model(spec["model"], layout, dtype=dtypes[dist_opt])
            before = _params(built.chunks)
            trainable = TrainableModel(built, settings[dist_opt])
            owned: dict = {}
            if dist_opt:

                def record(t=trainable, g=ref_grads, into=owned) -> None:
                    into.update(zip(("diff", "covers_all"), _owned_grad_diff(t, g), strict=True))

                trainable.after_backward = record
            step, _ = _train_once(trainable, batch, mode, vocab, weight=weights[dist_opt])
            if dist_opt:
                diff = owned["diff"]
            else:
                after = _params(trainable)
                diff = max(
                    float(((before[n] - after[n]) - ref_grads[n]).abs().max()) for n in ref_grads
                )
            results[f"contract/{'distopt' if dist_opt else 'ddp'}/{mode}"] = {
                "updated": step.updated,
                "grad_diff": diff,
                "covers_all": owned.get("covers_all", True),
                "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
                "norm": step.grad_norm,
                "ref_norm": ref_norm,
            }


def _nan_and_bf16_checks(spec: dict, results: dict) -> None:
    from megarl.models.build import build_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout

    batch = torch.load(spec["batch"])
    layout = ParallelLayout()
    for dist_opt in (False, True):
        built = build_model(spec["model"], layout)
        before = _params(built.chunks)
        # The product's defaults: both overlaps on (bucket size 1: a bucket per parameter, so
        # that reduce-scatters launch one by one from the backward pass).
        trainable = TrainableModel(
            built,
            OptimizerSettings(lr=1e-2, use_distributed_optimizer=dist_opt, ddp_bucket_size=1),
        )
        overlap = _overlap_record(trainable)
        step, _ = _train_once(trainable, batch, "token-mean", built.dims.vocab_size, poison=True)
        after = _params(trainable)
        results[f"nan/{'distopt' if dist_opt else 'ddp'}"] = {
            "updated": step.updated,
            "norm": step.grad_norm,
            "unchanged": all(torch.equal(before[n], after[n]) for n in before),
        }
        # The run goes on: the next (finite) step updates the weights.
        step, _ = _train_once(trainable, batch, "token-mean", built.dims.vocab_size)
        pending = trainable._param_gather_pending
        replicas = _replicas_identical(_params(trainable))
        results[f"nan/{'distopt' if dist_opt else 'ddp'}"]["next_updated"] = step.updated
        ddp = trainable.chunks[0].ddp_config
        results[f"overlap/{'distopt' if dist_opt else 'ddp'}"] = {
            "ddp_config": {k: getattr(ddp, k) for k in OVERLAP_KEYS},
            "forward_pre_hooks": trainable.chunks[0].use_forward_hook,
            "buckets": len(trainable.chunks[0].bucket_groups),
            **overlap,
            "pending_after_step": pending,
            "replicas_identical_after_sync": replicas,
        }

    # bf16: the optimizer's fp32 main parameters must be the loaded weights (lr 0: exactly them).
    for dist_opt in (False, True):
        for lr in (0.0, 1e-3):
            built = build_model(spec["model"], layout, dtype=torch.bfloat16)
            loaded = _params(built.chunks)
            optimizer = "adam" if dist_opt else "sgd"  # the distributed optimizer is Adam-only
            trainable = TrainableModel(
                built,
                OptimizerSettings(
                    lr=lr, optimizer=optimizer, weight_decay=0.0, use_distributed_optimizer=dist_opt
                ),
            )
            step, _ = _train_once(trainable, batch, "token-mean", built.dims.vocab_size)
            after = _params(trainable)
            results[f"bf16/{'distopt' if dist_opt else 'ddp'}/lr{lr}"] = {
                "updated": step.updated,
                "max_change": max(float((after[n] - loaded[n]).abs().max()) for n in loaded),
                "grad_norm": step.grad_norm,
            }


def _warmup_from_lr_warmup_init(spec: dict, results: dict) -> None:
    """The learning rate before and after each of two steps of a 4-step warm-up from 1e-4 to
    1e-3 (optim.lr_warmup_init honoured, as Megatron's scheduler takes it in verl)."""
    from megarl.models.build import build_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout

    batch = torch.load(spec["batch"])
    built = build_model(spec["model"], ParallelLayout())
    settings = OptimizerSettings(lr=1e-3, lr_warmup_steps=4, lr_warmup_init=1e-4, lr_decay_steps=8)
    trainable = TrainableModel(built, settings)
    lrs = [trainable.lr]
    for _ in range(2):
        _train_once(trainable, batch, "token-mean", built.dims.vocab_size)
        trainable.advance_lr()  # once per trainer step
        lrs.append(trainable.lr)
    results["warmup_lrs"] = lrs


def _checkpoint_round_trip(spec: dict, results: dict) -> None:
    """Save model+optimizer after one Adam step; a fresh model (other weights) loads it; the next
    step on both must give bit-identical weights (moments and weights restored)."""
    from megatron.core import dist_checkpointing

    from megarl.models.build import build_model
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout

    batch = torch.load(spec["batch"])
    layout = ParallelLayout()
    for dist_opt in (False, True):
        settings = OptimizerSettings(lr=1e-2, use_distributed_optimizer=dist_opt)
        first = TrainableModel(build_model(spec["model"], layout), settings)
        vocab = first.model.dims.vocab_size
        _train_once(first, batch, "token-mean", vocab)
        ckpt = Path(spec["tmp"]) / f"ckpt_{dist_opt}"
        if dist.get_rank() == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(first.sharded_state_dict(), str(ckpt))
        fresh_model = build_model(first.model.dims, layout)  # random weights
        second = TrainableModel(fresh_model, settings)
        state = dist_checkpointing.load(second.sharded_state_dict(is_loading=True), str(ckpt))
        second.load_sharded_state_dict(state)
        same_weights = all(
            torch.equal(a, b) for a, b in zip(_params(first).values(), _params(second).values())
        )
        _train_once(first, batch, "token-mean", vocab)
        _train_once(second, batch, "token-mean", vocab)
        a, b = _params(first), _params(second)
        results[f"ckpt/{'distopt' if dist_opt else 'ddp'}"] = {
            "weights_loaded": same_weights,
            "after_next_step": max(float((a[n] - b[n]).abs().max()) for n in a),
        }


def _hybrid_optimizer_failures(spec: dict, results: dict) -> None:
    """Megatron-Core's HybridDeviceOptimizer (``optimizer_cpu_offload``) under megarl's
    distributed optimizer fails as megarl's refusal of it says (megarl/config/optim_overrides.py):
    fp32 parameters do not build, a CPU-only host cannot step, and (that lookup patched) the step
    after a weights-only load writes the stale main parameters back (compared with no offload)."""
    import dataclasses
    from unittest import mock

    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    import megarl.models.trainable as trainable_module
    from megarl.models.build import build_model
    from megarl.models.gpt import unwrap
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.layout import ParallelLayout

    batch, layout, bf16 = torch.load(spec["batch"]), ParallelLayout(), torch.bfloat16
    # Pinned host buffers need CUDA too.
    offload = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}
    offload |= {"pin_cpu_grads": False, "pin_cpu_params": False}

    build = trainable_module.get_megatron_optimizer  # megarl's one builder, its config changed

    def hybrid(config, chunks, **kwargs):
        return build(dataclasses.replace(config, **offload), chunks, **kwargs)

    original = HybridDeviceOptimizer._get_sub_optimizer_param_groups

    def host_params_as_own_copies(self, fraction):
        # On CPU every parameter lands in the "CPU" optimizers, whose step looks up the GPU
        # original of each; map each host parameter to itself so that the step can run.
        groups = original(self, fraction)
        for group in groups[0]:
            for param in group["params"]:
                groups[3].setdefault(param, param)
        return groups

    out: dict = {"reload_drift": {}}
    with mock.patch.object(trainable_module, "get_megatron_optimizer", hybrid):
        try:
            TrainableModel(build_model(spec["model"], layout), OptimizerSettings(lr=1e-2))
        except ValueError as exc:
            out["fp32_build"] = str(exc)
        trainable = TrainableModel(
            build_model(spec["model"], layout, dtype=bf16), OptimizerSettings(lr=1e-2)
        )
        try:
            _train_once(trainable, batch, "token-mean", trainable.model.dims.vocab_size)
        except KeyError:
            out["cpu_step"] = "KeyError"
    for name, patches in (("plain", ()), ("offload", (hybrid, host_params_as_own_copies))):
        with contextlib.ExitStack() as stack:
            if patches:
                stack.enter_context(
                    mock.patch.object(trainable_module, "get_megatron_optimizer", patches[0])
                )
                stack.enter_context(
                    mock.patch.object(
                        HybridDeviceOptimizer, "_get_sub_optimizer_param_groups", patches[1]
                    )
                )
            trainable = TrainableModel(
                build_model(spec["model"], layout, dtype=bf16),
                OptimizerSettings(lr=0.0, weight_decay=0.0, clip_grad=0.0),
            )
            other = build_model(trainable.model.dims, layout, dtype=bf16)  # random weights
            with torch.no_grad():
                for mine, new in zip(
                    unwrap(trainable.chunks[0]).parameters(),
                    unwrap(other.chunks[0]).parameters(),
                    strict=True,
                ):
                    mine.copy_(new)
            trainable.reload_model_params()  # what megarl's weights-only checkpoint load does
            _train_once(trainable, batch, "token-mean", trainable.model.dims.vocab_size)
            loaded, after = _params(other.chunks), _params(trainable)
            out["reload_drift"][name] = max(
                float((after[n] - loaded[n]).abs().max()) for n in loaded
            )
    results["hybrid"] = out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from megarl.parallel.init import destroy_distributed, init_distributed

    init_distributed(seed=1234)
    results: dict = {}
    _contract_checks(spec, results)
    _nan_and_bf16_checks(spec, results)
    _warmup_from_lr_warmup_init(spec, results)
    _checkpoint_round_trip(spec, results)
    _hybrid_optimizer_failures(spec, results)
    if dist.get_rank() == 0:
        torch.save(results, Path(spec["tmp"]) / "results_trainable.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
