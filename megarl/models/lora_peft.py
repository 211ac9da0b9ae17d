"""LoRA adapters between megarl's Megatron layout and PEFT's HF-named adapter folder.

Megatron fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``; one adapter on the
fused linear has one A and a B over the fused rows. In PEFT's per-projection form that is the
same A on ``q_proj``, ``k_proj`` and ``v_proj`` (``gate_proj``, ``up_proj``) and B split by rows
the way the base weight is (:func:`megarl.models.hf_mapping.megatron_param_to_hf` applied to B,
whose rows are the base weight's rows): ``B_q A x``, ``B_k A x``, ``B_v A x`` are exactly the
fused adapter's output rows.

MoE experts (local spec's ``SequentialMLP``) are written per expert under the checkpoint's names
(``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, global expert index), the PEFT
format of transformers 4 and of vLLM; ``peft`` (0.21) converts it onto transformers 5's fused
expert tensors when it loads it (``target_parameters``, gate/up at rank 2r). Expert adapters come
from every expert-parallel rank (:func:`megarl.models.weights.holds_first_copy`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.config.model_dims import ModelDims
from megarl.models import hf_mapping as hm
from megarl.models import moe_mapping as mm
from megarl.models.lora import LoraError, LoraSettings, adapted_linears
from megarl.models.lora_shards import merge_adapter_shards, shard_adapter
from megarl.models.weights import holds_first_copy
from megarl.parallel.collectives import all_gather_tensors, object_group

PEFT_PREFIX = "base_model.model."
"""PEFT's prefix of a ``PeftModelForCausalLM``'s adapter keys."""


def full_adapters(
    chunks: Sequence[torch.nn.Module],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{global base weight name: (full A, full B)} of this rank's pipeline stage (TP-gathered;
    collective over the TP group)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for _, name, linear in adapted_linears(chunks):
        a, b = linear.lora.A.detach(), linear.lora.B.detach()
        if tp > 1 and linear.lora.tp_size > 1:  # (expert linears are not TP-split)
            a_shards, b_shards = all_gather_tensors(a, group), all_gather_tensors(b, group)
        else:
            a_shards, b_shards = [a], [b]
        out[name] = merge_adapter_shards(linear.lora.parallel, name, a_shards, b_shards)
    return out


def _first_copies(
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapters of :func:`full_adapters` this rank contributes to a whole-model gather (one
    copy of each: dense ones from TP rank 0 of DP rank 0, expert ones from expert-DP rank 0 of
    every expert-parallel rank), on the CPU."""
    return {
        k: (a.cpu(), b.cpu())
        for k, (a, b) in adapters.items()
        if holds_first_copy(mm.is_expert_param(k))
    }


def _whole_model(chunks: Sequence[torch.nn.Module]) -> tuple[dict, float]:
    """({global base name: (full A, full B)} of the whole model, the adapters' scaling) on
    every rank (collective over all ranks; small: one copy of the adapters in all). A rank
    holding no adapter (a pipeline stage ``exclude_modules`` left bare) takes part too. The
    objects go over gloo (:func:`~megarl.parallel.collectives.object_group`): over NCCL PyTorch
    would stage world × the largest payload on every GPU."""
    scaling = next((lin.lora.scaling for _, _, lin in adapted_linears(chunks)), None)
    boxes: list = [None] * dist.get_world_size()
    mine = (_first_copies(full_adapters(chunks)), scaling)
    dist.all_gather_object(boxes, mine, group=object_group())
    adapters = {k: v for box, _ in boxes for k, v in box.items()}
    scalings = {s for _, s in boxes if s is not None}
    if len(scalings) != 1:
        raise LoraError(f"the ranks' adapters have scalings {sorted(scalings)}: expected one")
    return adapters, scalings.pop()


def adapters_to_hf(
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], dims: ModelDims
) -> dict[str, torch.Tensor]:
    """Full Megatron adapters -> PEFT state dict (``base_model.model.<module>.lora_A.weight``)."""
    out: dict[str, torch.Tensor] = {}
    for base_name, (a, b) in adapters.items():
        bs = hm.megatron_param_to_hf(base_name, b, dims)  # B's rows are the base weight's rows
        for hf_weight, b_part in bs.items():
            module = hf_weight.removesuffix(".weight")
            out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.clone()  # one copy per projection
            out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_part.contiguous()
    return out


def every_stage_adapters(
    chunks: Sequence[torch.nn.Module], dims: ModelDims
) -> tuple[dict[str, torch.Tensor], dict]:
    """The whole model's adapters in PEFT form on every rank, with their ``adapter_config``
    fields (``r``, ``lora_alpha``, ``target_modules``): what an adapter-only sync hands vLLM.
    Collective: TP all-gather, then one copy of each adapter (every stage's, every
    expert-parallel rank's experts) all-gathered over all ranks (small: the adapters only)."""
    adapters, scaling = _whole_model(chunks)
    state = adapters_to_hf(adapters, dims)
    rank = int(next(iter(adapters.values()))[0].shape[0])
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": scaling * rank,
        "target_modules": _hf_target_modules(state),
        "bias": "none",
    }
    return state, config


def _hf_target_modules(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state})


def export_peft_adapter(
    chunks: Sequence[torch.nn.Module],
    dims: ModelDims,
    settings: LoraSettings,
    out_dir: str | Path,
    *,
    base_model: str | None = None,
) -> Path | None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's LoRA format) from
    every rank's adapters (collective over all ranks; rank 0 writes and returns the folder)."""
    from safetensors.torch import save_file

    merged, _ = _whole_model(chunks)
    if dist.get_rank() != 0:
        return None
    state = adapters_to_hf(merged, dims)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": _hf_target_modules(state),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_peft_adapter(
    chunks: Sequence[torch.nn.Module], dims: ModelDims, settings: LoraSettings, folder: str | Path
) -> int:
    """Set this rank's adapters from a PEFT folder (``adapter_config.json`` +
    ``adapter_model.safetensors``, as :func:`export_peft_adapter` writes; verl's
    ``lora.adapter_path``); returns how many linears were set.

    Each fused linear takes B as the projections' B rows joined the way the base weight is
    (interleaved q/k/v groups, ``[gate; up]``) and their A, which must be one tensor: megarl's
    fused adapters share A (a PEFT adapter with separate q/k/v A's is refused). Raises
    :class:`~megarl.models.lora.LoraError` in one line naming what does not fit.
    """
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not (config_file.is_file() and weights.is_file()):
        raise LoraError(f"lora.adapter_path={folder}: no adapter_config.json and "
                        "adapter_model.safetensors there")  # fmt: skip
    config = json.loads(config_file.read_text())
    if config.get("target_parameters"):
        raise LoraError(
            f"lora.adapter_path={folder}: adapters on fused expert parameters (peft "
            f"target_parameters={config['target_parameters']}) are not read; megarl reads "
            "per-expert modules (mlp.experts.{e}.gate_proj/up_proj/down_proj), as it writes them"
        )
    if int(config.get("r", -1)) != settings.rank or float(config.get("lora_alpha", -1)) != float(
        settings.alpha
    ):
        raise LoraError(
            f"lora.adapter_path={folder}: r={config.get('r')}, lora_alpha="
            f"{config.get('lora_alpha')} where lora.rank={settings.rank}, alpha={settings.alpha}"
        )
    state = {k.replace(".default.", "."): v for k, v in load_file(str(weights)).items()}
    used: set[str] = set()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    count = 0
    for _, name, linear in adapted_linears(chunks):
        modules = [s.removesuffix(".weight") for s in hm.megatron_param_sources(name, dims)]
        keys = [(f"{PEFT_PREFIX}{m}.lora_A.weight", f"{PEFT_PREFIX}{m}.lora_B.weight")
                for m in modules]  # fmt: skip
        absent = [k for pair in keys for k in pair if k not in state]
        if absent:
            raise LoraError(f"lora.adapter_path={folder} has no {absent[0]}")
        a_parts = [state[a] for a, _ in keys]
        b_parts = [state[b] for _, b in keys]
        rows = dims.vocab_size if name == hm.OUTPUT_LAYER else None  # lm_head: unpadded
        _check_adapter_shapes(folder, keys, a_parts, b_parts, linear, rows)
        if any(not torch.equal(a, a_parts[0]) for a in a_parts[1:]):
            raise LoraError(
                f"lora.adapter_path={folder}: {modules} have different lora_A; megarl's fused "
                f"{name.rsplit('.', 2)[-2]} adapter shares one A (type=lora)"
            )
        if len(b_parts) == 3:
            b = hm.qkv_separate_to_megatron(*b_parts, dims)
        elif len(b_parts) == 2:
            b = hm.gate_up_to_fc1(*b_parts)
        else:
            (b,) = b_parts
        if name == hm.OUTPUT_LAYER:  # lm_head's vocabulary rows, padded as the output layer's
            b = torch.cat([b, b.new_zeros(dims.padded_vocab_size - b.shape[0], b.shape[1])])
        split = linear.lora.tp_size  # (expert linears: expert TP 1, not split)
        a, b = shard_adapter(linear.lora.parallel, name, a_parts[0], b, split,
                             tp_rank if split > 1 else 0)  # fmt: skip
        with torch.no_grad():
            linear.lora.A.copy_(a)
            linear.lora.B.copy_(b)
        used.update(k for pair in keys for k in pair)
        count += 1
    extra = sorted({_leaf(k) for k in state} - {_leaf(k) for k in used}) if count else []
    if extra:
        raise LoraError(f"lora.adapter_path={folder} adapts {extra}, which lora.target_modules "
                        "leave out")  # fmt: skip
    return count


def _check_adapter_shapes(folder, keys, a_parts, b_parts, linear, rows: int | None) -> None:
    """Refuse, in one line naming the folder and the tensor, an adapter of another base model:
    A must read the linear's full input width, B's rows add up to its output rows (``rows``
    when given: lm_head's unpadded vocabulary)."""
    lora = linear.lora
    in_f = lora.A.shape[1] * (lora.tp_size if lora.parallel == "row" else 1)
    want_a = (lora.A.shape[0], in_f)
    for (a_key, _), a in zip(keys, a_parts, strict=True):
        if tuple(a.shape) != want_a:
            raise LoraError(
                f"lora.adapter_path={folder}: {a_key} has shape {list(a.shape)}, this model's "
                f"linear takes {list(want_a)} (an adapter of another base model or rank?)"
            )
    out_f = rows or lora.B.shape[0] * (lora.tp_size if lora.parallel == "column" else 1)
    got = sum(int(b.shape[0]) for b in b_parts)
    if any(b.shape[1] != lora.B.shape[1] for b in b_parts) or got != out_f:
        raise LoraError(
            f"lora.adapter_path={folder}: {keys[0][1]} and its siblings have shapes "
            f"{[list(b.shape) for b in b_parts]}, this model's linear has {out_f} output rows "
            f"and rank {lora.B.shape[1]} (an adapter of another base model?)"
        )


def _leaf(peft_key: str) -> str:
    return peft_key.split(".lora_")[0].rsplit(".", 1)[-1]
