"""Every multi-rank LoRA check in one 4-rank torchrun launch (TP1/PP1, TP2, PP2, TP2×PP2, and
TP2 with sequence parallelism on the local spec, whose norms megarl marks for it).

For each layout the tiny Qwen2 actor gets adapters on all four linears with random non-zero A
and B (the same full tensors at every layout, :func:`megarl.models.lora.attach_adapters`), then
rank 0 records: the full-vocabulary logits, the logits with the adapters off, the gradients of a
fixed weighted sum of the response log-probs with respect to the adapters (full, Megatron
names), that the base weights got no gradient, and a PEFT export folder. The pytest side
(``test_lora_models.py``) compares them to HF transformers + ``peft``.
``python -m torch.distributed.run --nproc_per_node 4 _lora_worker.py SPEC.json``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (2, 1, True)]
"""(TP, PP, sequence parallelism)."""


def _full_logits(chunks, ids: torch.Tensor) -> torch.Tensor | None:
    """``[N, S, padded V]`` logits on every rank of the last stage (gathered over TP)."""
    from megatron.core import parallel_state

    from megarl.models.runner import forward_logits
    from megarl.parallel.collectives import all_gather_tensors

    kept = forward_logits(chunks, list(ids.split(2)))
    if kept is None:
        return None
    local = torch.cat(kept)
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return local
    return torch.cat(
        all_gather_tensors(local, parallel_state.get_tensor_model_parallel_group()), -1
    )


def _on_rank0(value):
    """``value`` from the first rank that has one (all ranks call)."""
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, value)
    return next((b for b in boxes if b is not None), None)


def _adapter_grads(chunks) -> dict:
    """{global base name: (full dA, full dB)} over every pipeline stage. Under sequence
    parallelism first Megatron's TP all-reduce of the parameters marked ``sequence_parallel``
    (what ``finalize_model_grads`` does; these chunks are not DDP-wrapped)."""
    from megatron.core import parallel_state

    from megarl.models.gpt import unwrap
    from megarl.models.lora import adapted_linears
    from megarl.models.lora_shards import merge_adapter_shards
    from megarl.parallel.collectives import all_gather_tensors

    config = unwrap(chunks[0]).config
    if config.sequence_parallel:
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import (
            _allreduce_non_tensor_model_parallel_grads,
        )

        for c in chunks:
            c.ddp_config = DistributedDataParallelConfig()
        _allreduce_non_tensor_model_parallel_grads(chunks, config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    mine = {}
    for _, name, lin in adapted_linears(chunks):
        ga, gb = lin.lora.A.grad, lin.lora.B.grad
        sa = all_gather_tensors(ga, group) if tp > 1 else [ga]
        sb = all_gather_tensors(gb, group) if tp > 1 else [gb]
        mine[name] = merge_adapter_shards(lin.lora.parallel, name, sa, sb)
    boxes: list = [None] * dist.get_world_size()
    keep = parallel_state.get_tensor_model_parallel_rank() == 0
    dist.all_gather_object(boxes, mine if keep else {})
    out: dict = {}
    for b in boxes:
        out.update(b)
    return out


def _adapted_everywhere(chunks) -> list[str]:
    """Global base weight names of every rank's adapted linears (all ranks call)."""
    from megarl.models.lora import adapted_linears

    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, [name for _, name, _ in adapted_linears(chunks)])
    return sorted({n for box in boxes for n in box})


def _matching_checks(results: dict) -> None:
    """``attach_adapters`` on a built 12-layer model at PP 2 (stage 1 holds layers 6-11, named
    0-5 locally): which linears get adapters for ``exclude_modules`` ``*.layers.1.*`` and
    ``layers.1`` (``target_modules: []``) and for the default targets; and that adapters are
    created on the device of the weight they adapt (a model moved to the meta device)."""
    from megarl.config.model_dims import ModelDims
    from megarl.models.build import build_model
    from megarl.models.lora import LoraSettings, attach_adapters
    from megarl.models.tiny import tiny_hf_config
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout(1, 2, None)
    init_distributed(layout, seed=1234)
    dims = ModelDims.from_hf_config(tiny_hf_config("qwen2", num_layers=12))
    cases = {"exclude *.layers.1.*": ((), ("*.layers.1.*",)), "exclude layers.1": ((), ("layers.1",)),
             "default targets": (LoraSettings(rank=2).target_modules, ())}  # fmt: skip
    matched = {}
    for key, (targets, excludes) in cases.items():
        chunks = build_model(dims, layout).chunks
        attach_adapters(
            chunks, LoraSettings(rank=2, target_modules=targets, exclude_modules=excludes)
        )
        matched[key] = _adapted_everywhere(chunks)
    results["matching"] = matched
    chunks = [c.to("meta") for c in build_model(dims, layout).chunks]
    attach_adapters(chunks, LoraSettings(rank=2, target_modules=()))
    from megarl.models.lora import adapted_linears

    devices = {(str(lin.lora.A.device), str(lin.lora.B.device), str(lin.weight.device))
               for _, _, lin in adapted_linears(chunks)}  # fmt: skip
    results["devices"] = _on_rank0(sorted(devices))
    results["init"] = _init_scales(dims, layout)


def _init_scales(dims, layout) -> dict:
    """Per init method (A and B drawn alike), the full A and B of every layer's ``linear_proj``
    (row-parallel) and ``linear_fc1`` (column-parallel) at rank 8, as attach_adapters makes
    them (collected from both stages)."""
    from megarl.models.build import build_model
    from megarl.models.lora import LoraSettings, attach_adapters
    from megarl.models.lora_peft import full_adapters

    out = {}
    for method in ("xavier", "kaiming", "normal"):
        chunks = build_model(dims, layout).chunks
        settings = LoraSettings(rank=8, a_init=method, b_init=method, seed=4)
        attach_adapters(chunks, settings)
        mine = {k: (a.clone(), b.clone()) for k, (a, b) in full_adapters(chunks).items()}
        boxes: list = [None] * dist.get_world_size()
        dist.all_gather_object(boxes, mine)
        merged = {k: v for box in boxes for k, v in box.items()}
        out[method] = {
            kind: [v for k, v in sorted(merged.items()) if k.endswith(f"{kind}.weight")]
            for kind in ("linear_proj", "linear_fc1")
        }
    return out


def _output_layer_checks(spec: dict, results: dict) -> None:
    """Adapters on every linear, the output layer too (``target_modules: []``), at TP 2 × PP 2:
    logits, a PEFT export and the merged HF export; its checkpoint loaded at TP 1 × PP 1 (into
    adapters of another seed) and its PEFT export loaded there by ``lora.adapter_path``."""
    from dataclasses import replace

    from megarl.checkpoint.dist_ckpt import load_model_checkpoint, save_model_checkpoint
    from megarl.models.build import build_model
    from megarl.models.lora import LoraSettings, attach_adapters, freeze_base
    from megarl.models.lora_peft import export_peft_adapter
    from megarl.models.weights import export_hf_weights
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    tmp, ids = Path(spec["tmp"]), torch.load(spec["batch"])["input_ids"]
    settings = LoraSettings(**{**spec["lora"], "target_modules": ()})
    r: dict = {}
    layout = ParallelLayout(2, 2, None)
    init_distributed(layout, seed=1234)
    built = build_model(spec["model"], layout)
    attach_adapters(built.chunks, settings)
    freeze_base(built.chunks)
    r["adapted"] = _adapted_everywhere(built.chunks)
    for c in built.chunks:
        c.eval()
    r["logits"] = _on_rank0(_full_logits(built.chunks, ids))
    export_peft_adapter(built.chunks, built.dims, settings, tmp / "peft_out_tp2_pp2",
                        base_model=spec["model"])  # fmt: skip
    export_hf_weights(
        built.chunks, tmp / "merged_out_tp2_pp2", built.dims, source_dir=spec["model"]
    )
    save_model_checkpoint(built.chunks, tmp / "ckpt_out_tp2_pp2")
    layout = ParallelLayout(1, 1, None)
    init_distributed(layout, seed=1234)
    other = build_model(spec["model"], layout)
    attach_adapters(other.chunks, replace(settings, seed=settings.seed + 1))
    load_model_checkpoint(other.chunks, tmp / "ckpt_out_tp2_pp2")
    export_peft_adapter(other.chunks, other.dims, settings, tmp / "peft_out_loaded")
    fresh, r["logits_from_peft"] = _from_peft(spec, layout, settings, 2, "peft_out_tp2_pp2", ids)
    r["object_group"] = _object_group_check(fresh)
    results["output_layer"] = r


def _object_group_check(built) -> dict:
    """The adapter-only sync's whole-model gather with the default group reading as NCCL (a
    gloo world standing in, as tests/rollout/test_distribute.py does): its objects travel over
    a gloo group of their own, and the adapters come back the same."""
    from megarl.models.lora_peft import every_stage_adapters
    from megarl.parallel import collectives

    plain, _ = every_stage_adapters(built.chunks, built.dims)
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is None else real(group)
    try:
        state, _ = every_stage_adapters(built.chunks, built.dims)
        groups = list(collectives._GLOO_WORLD.values())
    finally:
        dist.get_backend = real
        collectives._GLOO_WORLD.clear()
    return {
        "groups": len(groups),
        "backend": real(groups[0]) if groups else None,
        "same": state.keys() == plain.keys()
        and all(torch.equal(state[k], plain[k]) for k in plain),
    }


def _layout_checks(spec: dict, tp: int, pp: int, sp: bool, results: dict) -> None:
    from megarl.models.build import build_model
    from megarl.models.gpt import unwrap
    from megarl.models.lora import LoraSettings, adapters_disabled, attach_adapters, freeze_base
    from megarl.models.lora_peft import export_peft_adapter
    from megarl.models.runner import SequenceBatch, forward_backward
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout(tp, pp, None, sequence_parallel=sp)
    init_distributed(layout, seed=1234)
    built = build_model(spec["model"], layout)
    chunks, dims = built.chunks, built.dims
    assert all(bool(unwrap(c).config.sequence_parallel) == sp for c in chunks)
    settings = LoraSettings(**spec["lora"])
    n = attach_adapters(chunks, settings)
    freeze_base(chunks)
    batch = torch.load(spec["batch"])
    ids = batch["input_ids"]
    r: dict = {"adapters_here": n}
    for c in chunks:
        c.eval()
    r["logits"] = _on_rank0(_full_logits(chunks, ids))
    with adapters_disabled(chunks):
        r["logits_off"] = _on_rank0(_full_logits(chunks, ids))
    for c in chunks:
        c.train()

    def loss_fn(outputs, mb):
        return (outputs["log_probs"] * mb["w"]).sum(), {}

    seqs = SequenceBatch(ids, batch["prompt_lengths"], batch["lengths"], extra={"w": batch["w"]})
    forward_backward(chunks, seqs, loss_fn, micro_batches=2, vocab_size=dims.vocab_size)
    r["grads"] = _adapter_grads(chunks)
    base_grads = [p.grad is not None for c in chunks for name, p in c.named_parameters()
                  if ".lora." not in name]  # fmt: skip
    r["base_grads"] = _on_rank0(sum(base_grads))
    key = f"tp{tp}_pp{pp}" + ("_sp" if sp else "")
    export_peft_adapter(chunks, dims, settings, Path(spec["tmp"]) / f"peft_{key}",
                        base_model=spec["model"])  # fmt: skip
    results[key] = r
    if key == "tp2_pp2":  # the HF export merges the adapters (the policy the actor is)
        from megarl.models.weights import export_hf_weights

        export_hf_weights(chunks, Path(spec["tmp"]) / "merged_tp2_pp2", dims,
                          source_dir=spec["model"])  # fmt: skip
    if key == "tp2_pp2":  # lora.adapter_path: TP1/PP1's export loaded into adapters of another seed
        _adapter_path_checks(spec, layout, settings, ids, r)
    ckpt = Path(spec["tmp"]) / "ckpt_tp2_pp1"
    if key == "tp2_pp1":
        from megarl.checkpoint.dist_ckpt import save_model_checkpoint

        save_model_checkpoint(chunks, ckpt)
    if key == "tp1_pp2":  # TP 2's checkpoint loaded at PP 2 into adapters of another seed
        from dataclasses import replace

        from megarl.checkpoint.dist_ckpt import load_model_checkpoint

        other = build_model(spec["model"], layout)
        attach_adapters(other.chunks, replace(settings, seed=settings.seed + 1))
        load_model_checkpoint(other.chunks, ckpt)
        export_peft_adapter(other.chunks, dims, settings, Path(spec["tmp"]) / "peft_loaded")


def _from_peft(spec: dict, layout, settings, seed_shift: int, folder: str, ids: torch.Tensor):
    """(model, rank 0's logits) of a fresh model whose adapters (of another seed) were set by
    ``load_peft_adapter`` from the PEFT folder ``tmp/folder`` (``lora.adapter_path``)."""
    from dataclasses import replace

    from megarl.models.build import build_model
    from megarl.models.lora import attach_adapters
    from megarl.models.lora_peft import load_peft_adapter

    built = build_model(spec["model"], layout)
    attach_adapters(built.chunks, replace(settings, seed=settings.seed + seed_shift))
    load_peft_adapter(built.chunks, built.dims, settings, Path(spec["tmp"]) / folder)
    for c in built.chunks:
        c.eval()
    return built, _on_rank0(_full_logits(built.chunks, ids))


def _adapter_path_checks(spec: dict, layout, settings, ids: torch.Tensor, r: dict) -> None:
    """``load_peft_adapter`` of TP1/PP1's PEFT export at this layout: its logits; and the one
    lines refusing a PEFT folder whose q/k/v A's differ and one of another base model."""
    tmp = Path(spec["tmp"])
    other, r["logits_from_peft"] = _from_peft(spec, layout, settings, 7, "peft_tp1_pp1", ids)

    def untie(state: dict) -> None:  # one A of q/k/v differs: not one fused adapter
        key = next(k for k in state if "k_proj.lora_A" in k)
        state[key] = state[key] + 1.0

    def widen(state: dict) -> None:  # q_proj's A 64 wide: an adapter of a hidden-64 model
        key = next(k for k in state if "layers.0.self_attn.q_proj.lora_A" in k)
        state[key] = torch.zeros(state[key].shape[0], 64)

    r["untied_refusal"] = _refusal_of_edited(tmp, other, settings, "peft_untied", untie)
    r["other_base_refusal"] = _refusal_of_edited(tmp, other, settings, "peft_hidden64", widen)


def _refusal_of_edited(tmp: Path, built, settings, name: str, edit) -> str | None:
    """The one line ``load_peft_adapter`` raises for TP1/PP1's export with ``edit`` applied
    to its tensors (written by rank 0 to ``tmp/name``), or None."""
    from safetensors.torch import load_file, save_file

    from megarl.models.lora import LoraError
    from megarl.models.lora_peft import load_peft_adapter

    folder, source = tmp / name, tmp / "peft_tp1_pp1"
    if dist.get_rank() == 0:
        folder.mkdir(exist_ok=True)
        state = load_file(str(source / "adapter_model.safetensors"))
        edit(state)
        save_file(state, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    dist.barrier()
    try:
        load_peft_adapter(built.chunks, built.dims, settings, folder)
    except LoraError as exc:
        return _on_rank0(str(exc))
    return _on_rank0(None)


def _moe_checks(spec: dict, results: dict) -> None:
    """The tiny Qwen3-MoE at TP 1 × EP 2: attach_adapters' one-line refusal of grouped-GEMM
    experts (the flag set on the model's config), then adapters on attention and every expert's
    linears: the logits with random non-zero adapters and the full adapters by global name; at
    TP 2 × EP 2 with expert TP 2, the one-line refusal."""
    from megarl.models.build import build_model
    from megarl.models.lora import LoraError, LoraSettings, attach_adapters
    from megarl.models.lora_peft import full_adapters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout(1, 1, None, expert_model_parallel_size=2)
    init_distributed(layout, seed=1234)
    built = build_model(spec["moe_model"], layout)
    config = built.chunks[0].config
    config.moe_grouped_gemm = True
    try:
        attach_adapters(built.chunks, LoraSettings(rank=4))
        results["moe_refusal"] = None
    except LoraError as exc:
        results["moe_refusal"] = str(exc)
    config.moe_grouped_gemm = False
    settings = LoraSettings(**spec["lora"])
    n = attach_adapters(built.chunks, settings)
    for c in built.chunks:
        c.eval()
    ids = torch.load(spec["batch"])["input_ids"]
    logits = _on_rank0(_full_logits(built.chunks, ids))
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, {k: (a.clone(), b.clone())
                                   for k, (a, b) in full_adapters(built.chunks).items()})  # fmt: skip
    adapters = {k: v for box in boxes for k, v in box.items()}
    results["moe"] = {"logits": logits, "adapters": adapters, "attached_here": n}
    layout = ParallelLayout(2, 1, None, expert_model_parallel_size=2)  # expert TP = TP = 2
    init_distributed(layout, seed=1234)
    split = build_model(spec["moe_model"], layout)
    try:
        attach_adapters(split.chunks, settings)
        results["etp_refusal"] = None
    except LoraError as exc:
        results["etp_refusal"] = str(exc)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from megarl.parallel.init import destroy_distributed, read_launch_env

    world = read_launch_env().world_size
    assert world == 4, world
    results: dict = {}
    for tp, pp, sp in LAYOUTS:
        _layout_checks(spec, tp, pp, sp, results)
    _moe_checks(spec, results)
    _matching_checks(results)
    _output_layer_checks(spec, results)
    if dist.get_rank() == 0:
        torch.save(results, Path(spec["tmp"]) / "lora_results.pt")
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    from tests._worker_exit import exit_now

    main()
    exit_now()
