"""MoE checks (Qwen3-MoE, Mixtral) run inside the shared multi-rank launch of each world size
(``_parallel_worker.py``): logits against transformers at TP×PP×EP(×ETP) layouts with both CPU
token dispatchers, HF export from each layout (the pytest side compares it bit for bit with the
source), and a dist checkpoint saved at one expert layout and loaded at another.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

# (tp, pp, ep, etp, dispatcher): EP 1/2, TP 1/2, PP 1/2, ETP = TP or 1, both dispatchers.
MOE_LAYOUTS = {
    1: [(1, 1, 1, None, "alltoall")],
    2: [
        (1, 1, 2, None, "alltoall"),
        (1, 1, 2, None, "allgather"),
        (2, 1, 1, None, "alltoall"),
        (1, 2, 1, None, "allgather"),
        (2, 1, 2, 1, "alltoall"),
    ],
    4: [(2, 2, 2, 1, "alltoall"), (1, 2, 2, None, "allgather")],
}


# (tp, pp, ep) of the routing replay check (sequence parallel at TP 2: each rank routes a slice).
REPLAY_LAYOUTS = {2: [(1, 1, 2)], 4: [(2, 2, 1)]}


# (tp, pp) of the router-loss check (sequence parallel at TP 2).
ROUTER_LOSS_LAYOUTS = {1: [(1, 1, 1)], 2: [(2, 1, 1), (1, 1, 2)], 4: [(2, 2, 1)]}
"""(TP, PP, CP); context parallelism runs packed rows."""
ROUTER_LOSS_COEFFS = {"moe_aux_loss_coeff": 0.5, "moe_z_loss_coeff": 0.25}
"""Large enough that the routers' gradients are far above float32's rounding."""
ROUTER_LOSS_MICRO_BATCH = 2
"""Sequences per micro-batch: the batch's two micro-batches have different token counts."""


def layout_key(tp: int, pp: int, ep: int, etp: int | None, dispatcher: str) -> str:
    return f"moe/tp{tp}_pp{pp}_ep{ep}_etp{etp or tp}_{dispatcher}"


def _layout(tp, pp, ep, etp):
    from megarl.parallel.layout import ParallelLayout

    return ParallelLayout(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def _build(path: str, layout, dispatcher: str):
    from megarl.models.build import build_model
    from megarl.models.gpt import MoeSettings
    from megarl.parallel.init import init_distributed

    init_distributed(layout, seed=1234)
    moe = MoeSettings.from_dict({"moe_token_dispatcher_type": dispatcher})
    return build_model(path, layout, moe=moe)


def _logit_diff(chunks, dims, ids: torch.Tensor, lengths: torch.Tensor, ref: torch.Tensor) -> float:
    """max |Δlogit| over real positions against HF's logits (max over ranks)."""
    from megarl.models.runner import forward_logits, gather_vocab

    for c in chunks:
        c.eval()
    kept = forward_logits(chunks, list(ids.split(2)))
    diff = 0.0
    if kept is not None:
        logits = gather_vocab(torch.cat(kept), dims.vocab_size)
        for i, n in enumerate(lengths.tolist()):
            diff = max(diff, (logits[i, :n] - ref[i, :n]).abs().max().item())
    t = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_moe_checks(spec: dict, world: int, results: dict) -> None:
    from megarl.models.weights import export_hf_weights

    start = time.perf_counter()
    batch = torch.load(spec["moe_batch"])
    ids, lengths = batch["input_ids"], batch["lengths"]
    tmp = Path(spec["tmp"])
    for tp, pp, ep, etp, dispatcher in MOE_LAYOUTS[world]:
        key = layout_key(tp, pp, ep, etp, dispatcher)
        for name, path in spec["moe_models"].items():
            ref = torch.load(Path(path) / "ref_logits.pt")
            built = _build(path, _layout(tp, pp, ep, etp), dispatcher)
            r = {"logit_diff": _logit_diff(built.chunks, built.dims, ids, lengths, ref)}
            if dispatcher == "alltoall":  # the export does not depend on the dispatcher
                out = tmp / f"export_{key.replace('/', '_')}_{name}"
                export_hf_weights(built.chunks, out, built.dims, source_dir=path)
                r["export"] = str(out)
            results[f"{key}/{name}"] = r
    if world == 2:
        _checkpoint_across_expert_layouts(spec, results)
        _dist_checkpoint_init(spec, results)
    for tp, pp, ep in REPLAY_LAYOUTS.get(world, []):
        results[f"moe/replay_tp{tp}_pp{pp}_ep{ep}"] = _routing_replay(spec, tp, pp, ep)
    for tp, pp, cp in ROUTER_LOSS_LAYOUTS.get(world, []):
        results[f"moe/router_losses_tp{tp}_pp{pp}_cp{cp}"] = _router_losses(spec, tp, pp, cp)
    results["moe/seconds"] = time.perf_counter() - start  # this launch's added time


def _checkpoint_across_expert_layouts(spec: dict, results: dict) -> None:
    """Save at EP=2, load at TP=2 (experts split by ETP=2 instead): every parameter equals the
    one loaded from HF at the target layout."""
    from megarl.checkpoint.dist_ckpt import load_model_checkpoint, save_model_checkpoint
    from megarl.models.build import build_model
    from megarl.models.weights import local_global_names

    path = spec["moe_models"]["qwen3_moe"]
    ckpt = Path(spec["tmp"]) / "moe_ckpt_ep2"
    src, dst = _layout(1, 1, 2, None), _layout(2, 1, 1, None)
    save_model_checkpoint(_build(path, src, "alltoall").chunks, ckpt, meta={"layout": "ep2"})
    direct = _build(path, dst, "alltoall")
    loaded = build_model(direct.dims, dst).chunks
    load_model_checkpoint(loaded, ckpt)
    pairs = zip(local_global_names(direct.chunks), local_global_names(loaded), strict=True)
    same = all(a[2] == b[2] and torch.equal(a[3], b[3]) for a, b in pairs)
    flag = torch.tensor([0 if same else 1])
    dist.all_reduce(flag)
    results["moe/ckpt_ep2_to_tp2"] = {"weights_identical": int(flag.item()) == 0}


def _dist_checkpoint_init(spec: dict, results: dict) -> None:
    """Initial weights from ``megarl convert``'s EP=2 checkpoint of the tiny Qwen3-MoE
    (``use_dist_checkpointing``: the trainer's loader, the model built from the checkpoint's
    ``hf_files/``, no safetensors) as the actor at EP 1 and as the critic at EP 2: every
    parameter equals the one built from HF."""
    from megarl.models.build import build_model
    from megarl.models.weights import local_global_names
    from megarl.parallel.init import init_distributed
    from megarl.trainer.setup import build_role_model

    hf, ckpt = spec["moe_models"]["qwen3_moe"], Path(spec["moe_dist_ckpt"])
    for ep, role in ((1, "actor"), (2, "critic")):
        layout = _layout(1, 1, ep, None)
        init_distributed(layout, seed=1234)
        kw = {"role": role, "value_head_seed": 7}
        direct = build_model(hf, layout, **kw).chunks
        assert not list((ckpt / "hf_files").glob("*.safetensors"))
        loaded = build_role_model(ckpt, ckpt / "hf_files", layout, **kw).chunks
        pairs = list(zip(local_global_names(direct), local_global_names(loaded), strict=True))
        diff = max((a[3] - b[3]).abs().max().item() for a, b in pairs)
        experts = sum(".experts." in a[2] for a, _ in pairs)
        t = torch.tensor([diff, experts], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results[f"moe/dist_ckpt_init_ep{ep}_{role}"] = {
            "max_diff": t[0].item(),
            "experts": t[1].item(),
        }


def _routing_replay(spec: dict, tp: int, pp: int, ep: int) -> dict:
    """Routing replay (megarl.models.routing) at one layout, Qwen3-MoE, seen through forward
    hooks on the routers (their routing maps, an observation independent of the replay):

    A. record at 2 sequences a micro-batch;
    B. perturb the routers' weights: without replay some real tokens go to other experts;
    C. the same weights, replaying A: every token's experts equal A's, and the replay's own
       agreement count equals the share of real tokens whose top-k of the router's logits
       (computed here from the hooked input and weight) is A's;
    D. the original weights, replaying A at 1 sequence a micro-batch (other padding, other
       token order): log-probs equal A's (a mis-sliced replay would move them).
    E. packed rows (THD), the original weights: recording routes every real token as A, the
       log-probs equal A's; with B's perturbed routers, replaying A on packed rows gives C's
       log-probs (a replay mapped to the wrong tokens would move them).
    """
    from megatron.core import parallel_state

    from megarl.models.build import build_model
    from megarl.models.expert_load import ExpertLoad
    from megarl.models.gpt import MoeSettings, unwrap
    from megarl.models.routing import ROUTING, Routing, routers
    from megarl.models.runner import SequenceBatch, compute_log_probs
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    batch = torch.load(spec["moe_batch"])
    lengths = batch["lengths"]
    plain = SequenceBatch(batch["input_ids"], torch.full_like(lengths, 3), lengths)
    # MoE layers train at TP > 1 under sequence parallelism only (the local spec's marked norms)
    layout = ParallelLayout(tp, pp, expert_model_parallel_size=ep, sequence_parallel=tp > 1)
    init_distributed(layout, seed=1234)
    moe = MoeSettings.from_dict({"moe_enable_routing_replay": True})
    built = build_model(spec["moe_models"]["qwen3_moe"], layout, moe=moe)
    chunks = built.chunks
    for c in chunks:
        c.eval()
    mine = [r for c in chunks for r in routers(c)]
    maps: list[torch.Tensor] = []
    own: list[torch.Tensor] = []  # each call's routing map had the router chosen afresh

    def hook(router, inputs, out):
        maps.append(out[1].detach().clone())
        with torch.no_grad():
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            logits = torch.nn.functional.linear(x.float(), router.weight.float())
            top = logits.topk(router.topk, dim=-1).indices
            own.append(torch.zeros_like(out[1]).scatter(1, top, True))

    hooks = [r.register_forward_hook(hook) for r in mine]

    def run(seqs: SequenceBatch, micro: int, routing=None, pack: bool = False):
        maps.clear()
        own.clear()
        out = compute_log_probs(chunks, seqs, vocab_size=built.dims.vocab_size,
                                micro_batches=micro, routing=routing, pack=pack)  # fmt: skip
        return out, list(maps)

    record = Routing(chunks, "record")
    with ExpertLoad(chunks) as load:  # also counts every real token's experts
        recorded, a_maps = run(plain, 2, record)
    load_expected = _expert_load_of(recorded.routing, record.layer_numbers, lengths, built.dims)
    replayed = SequenceBatch(plain.input_ids, plain.prompt_lengths, lengths,
                             extra={ROUTING: recorded.routing})  # fmt: skip
    originals = [r.weight.detach().clone() for r in mine]
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for r in mine:
            r.weight.add_((torch.randn(r.weight.shape, generator=g) * r.weight.std()).to(r.weight))
    _, b_maps = run(plain, 2)
    replay = Routing(chunks, "replay")
    c_out, c_maps = run(replayed, 2, replay)
    c_own = list(own)
    e_replayed, _ = run(replayed, 2, Routing(chunks, "replay"), pack=True)
    with torch.no_grad():
        for r, w in zip(mine, originals, strict=True):
            r.weight.copy_(w)
    d_out, _ = run(replayed, 1, Routing(chunks, "replay"))
    e_recorded, _ = run(plain, 2, Routing(chunks, "record"), pack=True)
    for h in hooks:
        h.remove()

    # Real tokens of each router call: micro-batch i // layers, sequence-major, this TP rank's
    # slice of the positions under sequence parallelism.
    sp = unwrap(chunks[0]).config.sequence_parallel
    rank = parallel_state.get_tensor_model_parallel_rank() if sp else 0
    same_b = same_c = real = 0
    for i, (a, b, c) in enumerate(zip(a_maps, b_maps, c_own, strict=True)):
        rows = lengths[2 * (i // len(mine)) :][:2]
        s_local = a.shape[0] // 2
        pos = torch.arange(s_local * rank, s_local * (rank + 1))[:, None]
        valid = (pos < rows[None, :]).reshape(-1)
        same_b += int((a == b).all(-1)[valid].sum())
        same_c += int((a == c).all(-1)[valid].sum())
        real += int(valid.sum())
    replay_same = all(torch.equal(a, c) for a, c in zip(a_maps, c_maps, strict=True))
    counts = [same_b, real, float(replay.agree), float(replay.tokens), float(replay_same),
              len(a_maps), same_c]  # fmt: skip
    counts = torch.tensor(counts, dtype=torch.float64)
    dist.all_reduce(counts)
    real_positions = torch.arange(recorded.routing.shape[2])[None, :] < lengths[:, None]
    packed_routing_same = torch.equal(
        e_recorded.routing.transpose(1, 2)[real_positions],
        recorded.routing.transpose(1, 2)[real_positions],
    )
    diff = torch.tensor([
        (d_out.log_probs - recorded.log_probs).abs().max(),
        (e_recorded.log_probs - recorded.log_probs).abs().max(),
        (e_replayed.log_probs - c_out.log_probs).abs().max(),
        float(not packed_routing_same),
    ], dtype=torch.float64)  # fmt: skip
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return {
        "routed_as_recorded_without_replay": counts[0].item() / max(counts[1].item(), 1.0),
        "agreement_counted": counts[2].item() / max(counts[3].item(), 1.0),
        "agreement_seen": counts[6].item() / max(counts[1].item(), 1.0),
        "replay_equals_recorded": counts[4].item() == dist.get_world_size(),
        "router_calls": counts[5].item(),
        "logprob_diff_other_micro_batches": diff[0].item(),
        "packed_logprob_diff": diff[1].item(),
        "packed_replay_logprob_diff": diff[2].item(),
        "packed_routing_as_recorded": diff[3].item() == 0.0,
        "expert_load": load.metrics(),
        "expert_load_expected": load_expected,
    }


def _router_losses(spec: dict, tp: int, pp: int, cp: int = 1) -> dict:
    """One forward and backward of the tiny Qwen3-MoE (float32, SGD, Megatron DDP) whose only
    loss is the routers' (load balancing and z-loss; the policy's share is multiplied by 0), in
    micro-batches of :data:`ROUTER_LOSS_MICRO_BATCH`: every router's weight gradient after
    ``finalize_model_grads`` (by decoder layer, from every pipeline stage) and the reported
    ``moe_aux_loss`` / ``moe_z_loss``. The pytest side computes both from transformers' router
    logits (tests/models/test_moe_models.py)."""
    from megarl.models.build import build_model
    from megarl.models.gpt import MoeSettings
    from megarl.models.routing import routers
    from megarl.models.runner import SequenceBatch, forward_backward
    from megarl.models.trainable import OptimizerSettings, TrainableModel
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout(tp, pp, sequence_parallel=tp > 1, context_parallel_size=cp)
    init_distributed(layout, seed=1234)
    moe = MoeSettings.from_dict({"moe_router_load_balancing_type": "aux_loss",
                                 **ROUTER_LOSS_COEFFS})  # fmt: skip
    built = build_model(spec["moe_models"]["qwen3_moe"], layout, moe=moe)  # float32: MoE GEMMs
    sgd = OptimizerSettings(lr=0.0, optimizer="sgd", weight_decay=0.0, clip_grad=0.0,
                            grad_reduce_in_fp32=False, use_distributed_optimizer=False)  # fmt: skip
    model = TrainableModel(built, sgd)
    batch = torch.load(spec["moe_batch"])
    lengths = batch["lengths"]
    seqs = SequenceBatch(batch["input_ids"], torch.full_like(lengths, 3), lengths)
    per_micro = forward_backward(
        model.chunks, seqs, lambda outputs, mb: (outputs["log_probs"].sum() * 0.0, {}),
        micro_batches=ROUTER_LOSS_MICRO_BATCH, vocab_size=built.dims.vocab_size, pack=cp > 1,
    )  # fmt: skip
    grads = {r.layer_number - 1: r.weight.main_grad.detach().double().cpu()
             for c in model.chunks for r in routers(c)}  # fmt: skip
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, grads)
    return {
        "grads": [g for g in everyone],  # each rank's own: TP peers must agree too
        "moe_aux_loss": sum(m.get("moe_aux_loss", 0.0) for m in per_micro),
        "moe_z_loss": sum(m.get("moe_z_loss", 0.0) for m in per_micro),
    }


def _expert_load_of(recorded: torch.Tensor, layer_numbers, lengths, dims) -> dict[str, float]:
    """megarl.models.expert_load's summary computed from the recorded routing instead (``[rows,
    layers, positions, k]``, this rank's layers; real positions only), over every rank's layers."""
    ratios = torch.zeros(dims.num_layers, dtype=torch.float64)
    real = torch.arange(recorded.shape[2])[None, :] < lengths[:, None]
    for i, layer in enumerate(layer_numbers):
        chosen = recorded[:, i][real].reshape(-1).long()
        counts = torch.bincount(chosen, minlength=dims.num_experts).double()
        ratios[layer] = counts.max() / counts.mean()
    dist.all_reduce(ratios, op=dist.ReduceOp.MAX)  # each layer on one stage, the same elsewhere
    return {
        "expert_load_imbalance": float(ratios.mean()),
        "expert_load_imbalance_max": float(ratios.max()),
        "expert_load_worst_layer": float(ratios.argmax()),
    }
