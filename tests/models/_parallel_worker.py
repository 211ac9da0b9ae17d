"""Runs every multi-rank model check for one world size in one torchrun launch.

Importing Megatron costs ~10 s per process on 2 cores, so the checks of a world size share one
launch (DESIGN.md). Rank 0 writes a dict of results (numbers and tensors) that the pytest side
asserts on: ``python -m torch.distributed.run --nproc_per_node W _parallel_worker.py SPEC.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _layouts(world: int) -> list[tuple[int, int, int | None]]:
    return {
        1: [(1, 1, None)],
        2: [(2, 1, None), (1, 2, None), (1, 2, 2)],
        4: [(2, 2, None)],
    }[world]


PACKING_LAYOUTS = {
    1: [(1, 1, None, 1)],
    2: [(2, 1, None, 1), (1, 2, None, 1), (1, 2, 2, 1), (1, 1, None, 2)],
    4: [(2, 2, None, 1), (2, 1, None, 2), (1, 2, None, 2)],
}
"""(TP, PP, VPP, CP) of the packed-row checks (context parallelism only with packed rows)."""
TEACHER_K = 5
"""The top-k a teacher's pass returns in the packed-row checks (issue 57's Megatron teacher)."""


def _packing_checks(spec: dict, layout, results: dict) -> None:
    """The tiny Qwen2 actor's log-probs and entropy of the packing batch at one layout, packed
    (uneven micro-batches, or two of three under VPP) and, without CP, right-padded; the
    critic's values likewise. Every rank returns them."""
    from megarl.models.build import build_model
    from megarl.models.runner import SequenceBatch, compute_log_probs, compute_values
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    tp, pp, vpp, cp = layout
    batch = torch.load(spec["packing_batch"])
    seqs = SequenceBatch(batch["input_ids"], batch["prompt_lengths"], batch["lengths"])
    micro = [torch.tensor([0, 3, 5]), torch.tensor([1, 2, 4])]
    if not vpp:
        micro = [torch.tensor([0, 3]), torch.tensor([1, 2, 4, 5])]
    parallel = ParallelLayout(tp, pp, vpp, context_parallel_size=cp)
    init_distributed(parallel, seed=1234)
    path = spec["models"]["qwen2"]
    built = build_model(path, parallel)
    r = {}
    for pack in (True, False) if cp == 1 else (True,):
        out = compute_log_probs(built.chunks, seqs, vocab_size=built.dims.vocab_size,
                                micro_batches=micro, temperature=0.7, pack=pack,
                                topk=TEACHER_K)  # fmt: skip
        name = "packed" if pack else "padded"
        r[f"{name}/log_probs"], r[f"{name}/entropy"] = out.log_probs, out.entropy
        r[f"{name}/topk_log_probs"], r[f"{name}/topk_ids"] = out.topk_log_probs, out.topk_ids
    critic = build_model(path, parallel, role="critic", value_head_seed=7)
    for pack in (True, False) if cp == 1 else (True,):
        name = "packed" if pack else "padded"
        r[f"{name}/values"] = compute_values(critic.chunks, seqs, micro_batches=micro, pack=pack)
    results[f"packing/tp{tp}_pp{pp}_vpp{vpp or 1}_cp{cp}"] = r


def _max_all(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _build(path: str, tp: int, pp: int, vpp: int | None, *, critic: bool = False):
    from megarl.models.build import build_model
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout(tp, pp, vpp)
    init_distributed(layout, seed=1234)
    built = build_model(path, layout, role="critic" if critic else "actor", value_head_seed=7)
    return built.dims, built.chunks


def _logits(chunks, ids: torch.Tensor) -> torch.Tensor | None:
    """Last-stage vocab-parallel logits ``[N, S, V/TP]`` via the pipeline schedule (None elsewhere)."""
    from megarl.models.runner import forward_logits

    kept = forward_logits(chunks, list(ids.split(2)))
    return None if kept is None else torch.cat(kept)


def _logit_diff(chunks, dims, ids, lengths, ref: torch.Tensor) -> float:
    from megatron.core import parallel_state

    logits = _logits(chunks, ids)
    diff = 0.0
    if logits is not None:
        local = logits.shape[-1]
        lo = parallel_state.get_tensor_model_parallel_rank() * local
        hi = min(lo + local, dims.vocab_size)
        for i, n in enumerate(lengths.tolist()):
            if hi > lo:
                d = (logits[i, :n, : hi - lo] - ref[i, :n, lo:hi]).abs().max().item()
                diff = max(diff, d)
    return _max_all(diff)


def _grads_as_hf(chunks, dims) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, TP-merged, in HF names, gathered to all ranks."""
    from megatron.core import parallel_state

    from megarl.models import hf_mapping as hm
    from megarl.models.gpt import ValueHead, unwrap
    from megarl.models.weights import gather_tp, local_global_names

    local: dict[str, torch.Tensor] = {}
    for i, _name, global_name, param in local_global_names(chunks):
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if global_name == hm.OUTPUT_LAYER and isinstance(unwrap(chunks[i]).output_layer, ValueHead):
            local["score.weight"] = grad.clone()
            continue
        full = gather_tp(global_name, grad, dims)
        local.update(
            {k: v.clone() for k, v in hm.megatron_param_to_hf(global_name, full, dims).items()}
        )
    keep = parallel_state.get_tensor_model_parallel_rank() == 0
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, local if keep else {})
    merged: dict[str, torch.Tensor] = {}
    for b in boxes:
        merged.update(b)
    return merged


def _model_checks(spec: dict, layout, results: dict) -> None:
    from megarl.models.runner import (
        SequenceBatch,
        compute_log_probs,
        compute_values,
        forward_backward,
    )

    tp, pp, vpp = layout
    batch = torch.load(spec["batch"])
    ids, plen, lens = batch["input_ids"], batch["prompt_lengths"], batch["lengths"]
    key = f"tp{tp}_pp{pp}_vpp{vpp or 1}"
    models = spec["models"] if vpp is None else {"qwen2": spec["models"]["qwen2"]}
    for name, path in models.items():
        ref = torch.load(Path(path) / "ref_logits.pt")
        dims, chunks = _build(path, tp, pp, vpp)
        for c in chunks:
            c.eval()
        r = {"logit_diff": _logit_diff(chunks, dims, ids, lens, ref)}
        for c in chunks:
            c.train()
        r["logit_diff_train_mode"] = _logit_diff(chunks, dims, ids, lens, ref)
        out = compute_log_probs(
            chunks,
            SequenceBatch(ids, plen, lens),
            vocab_size=dims.vocab_size,
            micro_batches=2,
            temperature=0.7,
        )
        r["log_probs"], r["entropy"] = out.log_probs, out.entropy
        if name == "qwen2":
            r["actor_engine"] = _actor_engine_check(chunks, dims)
        results[f"{key}/{name}"] = r

    # Critic: values and their gradients for a fixed weighted-sum loss.
    path = spec["models"]["qwen2"]
    dims, chunks = _build(path, tp, pp, vpp, critic=True)
    weights = torch.load(spec["batch"])["value_loss_weights"]

    def loss_fn(outputs, mb):
        return (outputs["values"] * mb["w"]).sum(), {}

    batch = SequenceBatch(ids, plen, lens, extra={"w": weights})
    forward_backward(chunks, batch, loss_fn, micro_batches=2)
    values = compute_values(chunks, batch, micro_batches=2)
    results[f"{key}/critic"] = {"values": values, "grads": _grads_as_hf(chunks, dims)}


def _reward_model_checks(spec: dict, layout, results: dict) -> None:
    """Reward-model scores of a right-padded batch at this layout (``scores [N]``, every rank)."""
    from megarl.models.build import build_model
    from megarl.models.runner import SequenceBatch, compute_scores
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    tp, pp, vpp = layout
    batch = torch.load(spec["rm_batch"])
    lengths = batch["lengths"]
    for name, path in spec["reward_models"].items():
        init_distributed(ParallelLayout(tp, pp, vpp), seed=1234)
        chunks = build_model(path, ParallelLayout(tp, pp, vpp), role="reward").chunks
        sequences = SequenceBatch(batch["input_ids"], lengths.clone(), lengths)
        results[f"tp{tp}_pp{pp}_vpp{vpp or 1}/{name}"] = {
            "scores": compute_scores(chunks, sequences, micro_batches=2),
            "packed_scores": compute_scores(chunks, sequences, micro_batches=2, pack=True),
        }


def _actor_engine_check(chunks, dims) -> dict:
    """Sample from the actor itself; the runner must score the samples as the engine did."""
    from megarl.models.runner import SequenceBatch, compute_log_probs
    from megarl.rollout.actor_engine import ActorEngine

    engine = ActorEngine(chunks, vocab_size=dims.vocab_size, eos_token_ids=[0])
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    kw = {"n": 2, "temperature": 0.7, "max_tokens": 6, "seed": 3}
    batch = engine.generate(prompts, **kw)
    again = engine.generate(prompts, **kw)
    other = engine.generate(prompts, **{**kw, "seed": 4})
    seqs = [s.prompt_token_ids + s.response_token_ids for s in batch]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, q in enumerate(seqs):
        ids[i, : len(q)] = torch.tensor(q)
    plen = torch.tensor([len(s.prompt_token_ids) for s in batch])
    lens = torch.tensor([len(q) for q in seqs])
    scored = compute_log_probs(
        chunks,
        SequenceBatch(ids, plen, lens),
        vocab_size=dims.vocab_size,
        micro_batches=3,
        temperature=0.7,
    ).log_probs
    diff = max(
        abs(scored[i, k].item() - lp)
        for i, s in enumerate(batch)
        for k, lp in enumerate(s.response_logprobs)
    )
    return {
        "tokens": [s.response_token_ids for s in batch],
        "order": [(s.prompt_index, s.sample_index) for s in batch],
        "finish": [s.finish_reason for s in batch],
        "reproducible": [s.response_token_ids for s in again]
        == [s.response_token_ids for s in batch],
        "seed_changes_tokens": [s.response_token_ids for s in other]
        != [s.response_token_ids for s in batch],
        "runner_diff": diff,
    }


def _vocab_parallel_check(results: dict) -> None:
    """TP=2 log-probs/entropy and gradients vs log_softmax on gathered, trimmed logits."""
    from megatron.core import parallel_state

    from megarl.models.logprobs import vocab_parallel_log_probs_and_entropy
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    init_distributed(ParallelLayout(2, 1))
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    vocab, padded = 1000, 1024
    g = torch.Generator().manual_seed(3)
    full = torch.randn(3, 7, padded, generator=g, dtype=torch.float64).float() * 3
    full[..., vocab:] = 1e4  # garbage in padded columns must not matter
    targets = torch.randint(0, vocab, (3, 7), generator=g)
    w_lp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    for temp in (0.7, 1.0):
        shard = full.chunk(2, dim=-1)[tp_rank].clone().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs_and_entropy(
            shard,
            targets,
            vocab_size=vocab,
            temperature=temp,
            vocab_start=tp_rank * padded // 2,
            group=group,
            chunk=3,
        )
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        ref_in = full[..., :vocab].clone().requires_grad_(True)
        logp_all = torch.log_softmax(ref_in / temp, dim=-1)
        ref_lp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
        ref_ent = -(logp_all.exp() * logp_all).sum(-1)
        ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
        ref_grad = torch.cat([ref_in.grad, torch.zeros(3, 7, padded - vocab)], dim=-1)
        ref_grad_shard = ref_grad.chunk(2, dim=-1)[tp_rank]
        results[f"vocab_parallel/T{temp}"] = {
            "lp": _max_all((lp - ref_lp).abs().max().item()),
            "ent": _max_all((ent - ref_ent).abs().max().item()),
            "grad": _max_all((shard.grad - ref_grad_shard).abs().max().item()),
        }


def _checkpoint_checks(spec: dict, results: dict) -> None:
    """Save at one layout, load at another: weights equal those loaded from HF at the target."""
    from megarl.checkpoint.dist_ckpt import load_model_checkpoint, save_model_checkpoint
    from megarl.models.build import build_model
    from megarl.models.runner import SequenceBatch, compute_log_probs
    from megarl.models.weights import local_global_names
    from megarl.parallel.layout import ParallelLayout

    batch = torch.load(spec["batch"])
    path = spec["models"]["qwen2"]
    for src, dst in (((2, 1), (1, 2)), ((1, 2), (2, 1))):
        ckpt = Path(spec["tmp"]) / f"ckpt_tp{src[0]}_pp{src[1]}"
        dims, chunks = _build(path, *src, None)
        sequences = SequenceBatch(batch["input_ids"], batch["prompt_lengths"], batch["lengths"])
        before = compute_log_probs(
            chunks, sequences, vocab_size=dims.vocab_size, micro_batches=2
        ).log_probs
        save_model_checkpoint(chunks, ckpt, meta={"layout": list(src)})
        dims, direct = _build(path, *dst, None)
        loaded = build_model(dims, ParallelLayout(*dst)).chunks
        load_model_checkpoint(loaded, ckpt)
        same = all(
            torch.equal(a[3], b[3])
            for a, b in zip(local_global_names(direct), local_global_names(loaded), strict=True)
        )
        after = compute_log_probs(
            loaded, sequences, vocab_size=dims.vocab_size, micro_batches=2
        ).log_probs
        flag = torch.tensor([0 if same else 1])
        dist.all_reduce(flag)
        results[f"ckpt/{src}->{dst}"] = {
            "weights_identical": int(flag.item()) == 0,
            "logprob_diff": (before - after).abs().max().item(),
        }


def _dist_checkpoint_init_checks(spec: dict, results: dict) -> None:
    """Initial weights from ``megarl convert``'s TP=2 checkpoint (``use_dist_checkpointing``),
    loaded at other layouts, equal those loaded from HF; a checkpoint of another shape is
    refused naming its path. The model is built from the checkpoint's ``hf_files/`` (config and
    tokenizer, no safetensors), so every weight must come from the checkpoint."""
    from megarl.checkpoint.dist_ckpt import CheckpointError
    from megarl.models.build import build_model
    from megarl.models.gpt import unwrap
    from megarl.models.weights import local_global_names
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.trainer.setup import build_role_model

    hf, ckpt = spec["dist_ckpt"]["hf"], spec["dist_ckpt"]["ckpt"]
    last3 = {"num_layers_in_last_pipeline_stage": 3}  # Megatron's uneven split: 1 + 3 layers
    cases = [((2, 1, None), "actor", {}), ((1, 2, None), "critic", {}), ((1, 2, 2), "actor", {}),
             ((1, 2, None), "actor", last3)]  # fmt: skip
    for (tp, pp, vpp), role, split in cases:
        layout = ParallelLayout(tp, pp, vpp, **split)
        init_distributed(layout, seed=1234)
        kw = {"role": role, "value_head_seed": 7}
        direct = build_model(hf, layout, **kw).chunks
        config_only = Path(ckpt) / "hf_files"
        assert not list(config_only.glob("*.safetensors"))
        loaded = build_role_model(Path(ckpt), config_only, layout, **kw).chunks
        diff = max(
            (a[3] - b[3]).abs().max().item()
            for a, b in zip(local_global_names(direct), local_global_names(loaded), strict=True)
        )
        key = f"dist_ckpt_init/tp{tp}_pp{pp}_vpp{vpp}{'_last3' if split else ''}/{role}"
        results[key] = _max_all(diff)
        if split:
            held = [None] * dist.get_world_size()
            dist.all_gather_object(held, [len(unwrap(chunk).decoder.layers) for chunk in loaded])
            results[f"{key}/layers"] = held
    try:
        build_role_model(Path(ckpt), spec["models"]["llama_untied"], layout)
        refused = ""
    except CheckpointError as exc:
        refused = str(exc)
    results["dist_ckpt_init/other_shape"] = refused


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from megarl.parallel.init import read_launch_env

    world = read_launch_env().world_size
    results: dict = {}
    for layout in PACKING_LAYOUTS[world]:
        _packing_checks(spec, layout, results)
    for layout in _layouts(world):
        _model_checks(spec, layout, results)
        if world == 2:  # reward models at TP=2, PP=2 and PP=2×VPP=2
            _reward_model_checks(spec, layout, results)
    if world == 2:
        _vocab_parallel_check(results)
        _checkpoint_checks(spec, results)
        _dist_checkpoint_init_checks(spec, results)
    if spec.get("moe_models"):  # Qwen3-MoE / Mixtral at EP/ETP layouts (test_moe_models.py)
        from tests.models._moe_checks import run_moe_checks

        run_moe_checks(spec, world, results)
    if world in (2, 4):  # Megatron's verdict on the layout rule's rows (test_layout_rule.py)
        from tests.models._layout_rule_checks import run_layout_rule_checks

        run_layout_rule_checks(results)
    if dist.get_rank() == 0:
        torch.save(results, Path(spec["tmp"]) / f"results_ws{world}.pt")
    dist.barrier()
    from megarl.parallel.init import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
