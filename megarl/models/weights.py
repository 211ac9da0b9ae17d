"""Move weights between a Hugging Face safetensors directory and sharded Megatron model chunks.

Loading: every rank reads (lazily) only the HF tensors its own parameters need and of those only
the rows or columns of its TP (for experts: expert-TP) shard, as safetensors slices
(:func:`read_tp_shard`): a rank of TP t reads about 1/t of its layers' weights, not all of them. Exporting: each parameter is all-gathered over its TP group and converted on TP rank 0;
every pipeline stage (and each expert-parallel rank, for its experts) writes its own safetensors
file, so no rank holds the whole model, and global rank 0 writes the index, config and tokenizer.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Self

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.config.model_dims import ModelDims, read_hf_config
from megarl.models import hf_mapping as hm
from megarl.models import moe_mapping as mm
from megarl.models.gpt import ValueHead, layer_offset, unwrap
from megarl.models.lora import ADAPTER_MARK
from megarl.models.vl_inputs import VISION_TOWER
from megarl.parallel.collectives import all_gather_tensors

VALUE_HEAD_HF_NAME = "score.weight"
"""HF name of the critic's value head (as ``*ForTokenClassification`` with one label)."""

_WEIGHT_FILE_SUFFIXES = (
    *(".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf"),
    ".index.json",
)
"""Files of an HF directory that hold weights (or index them); everything else (config,
tokenizer, generation config, chat template, ...) travels beside a converted checkpoint."""


def is_weight_file(name: str) -> bool:
    """Whether a file of an HF model directory holds (or indexes) weights."""
    return name.endswith(_WEIGHT_FILE_SUFFIXES)


class HFCheckpointReader:
    """Lazy, name-indexed reader over the safetensors files of an HF model directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"HF model directory not found: {self.path}")
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {k: self.path / v for k, v in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.path}")
            self._file_of = {}
            for f in files:
                with safe_open(f, framework="pt") as handle:
                    self._file_of.update({k: f for k in handle.keys()})  # noqa: SIM118 - safe_open is not iterable
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        self.bytes_read = 0
        """Bytes of tensors read so far (whole tensors and slices)."""

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} not found in {self.path}")
        f = self._file_of[name]
        if f not in self._handles:
            self._handles[f] = self._stack.enter_context(safe_open(f, framework="pt"))
        return self._handles[f]

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes_read += t.numel() * t.element_size()
        return t

    def get(self, name: str) -> torch.Tensor:
        return self._count(self._handle(name).get_tensor(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``name``'s elements ``start:stop`` along ``dim`` (0 or 1), read alone from the file."""
        part = self._handle(name).get_slice(name)
        return self._count(part[start:stop] if dim == 0 else part[:, start:stop])

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def local_global_names(
    chunks: Sequence[torch.nn.Module],
) -> Iterator[tuple[int, str, str, torch.nn.Parameter]]:
    """(chunk index, local name, global Megatron name, parameter) for this rank's parameters.

    Global names carry global layer indices and, for MoE experts, global expert indices.
    LoRA adapters' parameters (:mod:`megarl.models.lora`) are not base weights and are skipped,
    and so is a VL actor's vision tower (:data:`~megarl.models.vl_inputs.VISION_TOWER`: its
    own HF names, not the language model's mapping).
    """
    for i, chunk in enumerate(chunks):
        model = unwrap(chunk)
        offset = layer_offset(model.config, model.vp_stage)
        experts = model.config.num_moe_experts or 0
        ep_rank, local_experts = 0, 0
        if experts:
            ep_rank = parallel_state.get_expert_model_parallel_rank()
            local_experts = experts // parallel_state.get_expert_model_parallel_world_size()
        for name, param in model.named_parameters():
            if ADAPTER_MARK in f".{name}" or name.startswith(f"{VISION_TOWER}."):
                continue
            global_name = hm.megatron_name_to_global(hm.from_te_name(name), offset)
            if experts:
                global_name = mm.expert_name_to_global(global_name, ep_rank, local_experts)
            yield i, name, global_name, param


def tp_group_of(global_name: str) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group splitting ``global_name``: expert TP for
    expert weights, TP for everything else."""
    if mm.is_expert_param(global_name):
        return (
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_rank(),
        )
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


@torch.no_grad()
def load_hf_weights(
    chunks: Sequence[torch.nn.Module], hf_path: str | Path, dims: ModelDims
) -> None:
    """Fill this rank's shards of ``chunks`` from the HF checkpoint at ``hf_path``.

    The critic's value head is loaded from ``score.weight`` when the checkpoint has one and
    keeps its seeded initialisation otherwise. Missing HF tensors raise ``KeyError`` naming them.
    """
    with HFCheckpointReader(hf_path) as reader:
        for i, _local, global_name, param in local_global_names(chunks):
            if global_name == hm.OUTPUT_LAYER and isinstance(
                unwrap(chunks[i]).output_layer, ValueHead
            ):
                if VALUE_HEAD_HF_NAME in reader:
                    param.copy_(reader.get(VALUE_HEAD_HF_NAME).reshape(param.shape))
                continue
            tp_size, tp_rank = tp_group_of(global_name)
            shard = read_tp_shard(reader, global_name, dims, tp_size, tp_rank)
            if shard.shape != param.shape:
                raise ValueError(
                    f"{global_name}: shard shape {tuple(shard.shape)} != parameter shape "
                    f"{tuple(param.shape)} (TP={tp_size})"
                )
            param.copy_(shard.to(param.dtype))


def read_tp_shard(
    reader: HFCheckpointReader, mg_name: str, dims: ModelDims, tp_size: int, tp_rank: int
) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of the Megatron parameter ``mg_name`` (global name), equal to
    ``hm.tp_split(hm.hf_to_megatron_param(mg_name, reader.get, dims), ...)`` but reading from
    the checkpoint only what the shard holds: row-parallel weights their columns, ``linear_fc1``
    its gate and up rows, the vocabulary-parallel ones their rows (the padding made here), and
    ``linear_qkv`` its KV groups' q, k and v rows (TP dividing the groups). Replicated
    parameters, and ``linear_qkv`` with TP above the KV-group count (a rank holds part of a
    group), are read whole."""
    kind = hm.tp_partition_kind(mg_name)
    if tp_size == 1 or kind == "replicated":
        return hm.hf_to_megatron_param(mg_name, reader.get, dims)
    names = hm.megatron_param_sources(mg_name, dims)
    shape = hm.megatron_param_shape(mg_name, dims)
    lo, hi = tp_rank * shape[0] // tp_size, (tp_rank + 1) * shape[0] // tp_size
    if kind == "row" and shape[1] % tp_size == 0:
        cols = shape[1] // tp_size
        return reader.get_slice(names[0], 1, tp_rank * cols, (tp_rank + 1) * cols)
    if kind == "fc1" and shape[0] % (2 * tp_size) == 0:
        rows = shape[0] // 2 // tp_size
        gate, up = (reader.get_slice(n, 0, tp_rank * rows, (tp_rank + 1) * rows) for n in names)
        return hm.gate_up_to_fc1(gate, up)
    if kind == "vocab" and shape[0] % tp_size == 0:
        vocab = reader.shape(names[0])[0]
        if vocab != dims.vocab_size:
            raise ValueError(f"{names[0]}: {vocab} rows != vocab_size {dims.vocab_size}")
        part = reader.get_slice(names[0], 0, min(lo, vocab), min(hi, vocab))
        return torch.cat([part, part.new_zeros(hi - lo - part.shape[0], *part.shape[1:])])
    groups = dims.num_query_groups
    if kind == "column" and groups % tp_size == 0:
        first, count, d = tp_rank * groups // tp_size, groups // tp_size, dims.head_dim
        q_rows = dims.heads_per_group * d
        q = reader.get_slice(names[0], 0, first * q_rows, (first + count) * q_rows)
        k, v = (reader.get_slice(n, 0, first * d, (first + count) * d) for n in names[1:])
        return hm.qkv_separate_to_megatron(q, k, v, dims)
    full = hm.hf_to_megatron_param(mg_name, reader.get, dims)
    return hm.tp_split(mg_name, full, tp_size, tp_rank, dims)


def gather_tp(global_name: str, shard: torch.Tensor, dims: ModelDims) -> torch.Tensor:
    """The full Megatron parameter from every TP rank's shard (collective over the TP group;
    over expert TP for expert weights)."""
    expert = mm.is_expert_param(global_name)
    tp_size, _ = tp_group_of(global_name)
    if tp_size == 1 or hm.tp_partition_kind(global_name) == "replicated":
        return shard.detach()
    if expert:
        group = parallel_state.get_expert_tensor_parallel_group()
    else:
        group = parallel_state.get_tensor_model_parallel_group()
    return hm.tp_merge(global_name, all_gather_tensors(shard.detach(), group), dims)


def iter_full_hf_tensors(
    chunks: Sequence[torch.nn.Module],
    dims: ModelDims,
    *,
    with_expert_flag: bool = False,
    merge_adapters: bool = True,
) -> Iterator[tuple]:
    """HF-named full tensors of this rank's pipeline stage (TP-gathered; collective over TP,
    and over expert TP for experts).

    Every TP rank of the stage yields the same tensors; MoE experts are this rank's
    expert-parallel share. The tied output-layer copy on the last stage is skipped (the
    embedding carries it); a critic's value head comes as ``score.weight``. With
    ``with_expert_flag`` each item is ``(name, tensor, is_expert)``. LoRA adapters
    (:mod:`megarl.models.lora`) are merged into their weights (``W + scaling·B·A``: the policy
    the actor is) unless ``merge_adapters`` is False (the base weights).
    """
    from megarl.models.lora import merged_weights

    merged = merged_weights(chunks) if merge_adapters else {}
    for i, _local, global_name, param in local_global_names(chunks):
        param = merged.get(global_name, param)
        expert = mm.is_expert_param(global_name)
        if global_name == hm.OUTPUT_LAYER and isinstance(unwrap(chunks[i]).output_layer, ValueHead):
            items = [(VALUE_HEAD_HF_NAME, param.detach())]
        else:
            full = gather_tp(global_name, param, dims)
            items = list(hm.megatron_param_to_hf(global_name, full, dims).items())
        for name, tensor in items:
            yield (name, tensor, expert) if with_expert_flag else (name, tensor)


def holds_first_copy(expert: bool) -> bool:
    """Whether this rank holds the copy of a tensor of its stage that is written or gathered: TP
    rank 0 of data-parallel rank 0, and for experts expert-TP rank 0 of expert-data-parallel rank 0
    (one per expert-parallel rank)."""
    if expert:
        return (
            parallel_state.get_expert_tensor_parallel_rank() == 0
            and parallel_state.get_expert_data_parallel_rank() == 0
        )
    return (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def export_hf_weights(
    chunks: Sequence[torch.nn.Module],
    out_dir: str | Path,
    dims: ModelDims,
    *,
    source_dir: str | Path | None = None,
    hf_config: dict | None = None,
    dtype: torch.dtype | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write the model as an HF directory loadable by ``transformers`` (collective, all ranks).

    One safetensors file per pipeline stage (and, for MoE, per expert-parallel rank), written
    by the ranks :func:`holds_first_copy` picks, plus ``model.safetensors.index.json``; ``config.json``
    (``hf_config`` or the source's) and the tokenizer files of ``source_dir`` are copied by
    global rank 0. A vision-language actor's tower (on the first stage) goes beside its language
    model as ``visual.<name>``: the hub layout of a Qwen2(.5)-VL checkpoint.
    """
    out = Path(out_dir)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor, expert in iter_full_hf_tensors(chunks, dims, with_expert_flag=True):
        if holds_first_copy(expert):
            t = tensor.to(dtype) if dtype is not None else tensor
            tensors[name] = t.detach().to("cpu").contiguous().clone()
    vision = getattr(unwrap(chunks[0]), VISION_TOWER, None) if chunks else None
    if vision is not None and holds_first_copy(False):  # a VL actor: the hub layout's visual.*
        for name, tensor in vision.state_dict().items():
            t = tensor.to(dtype) if dtype is not None else tensor
            tensors[f"visual.{name}"] = t.detach().to("cpu").contiguous().clone()
    writer = bool(tensors)
    writers: list[bool | None] = [None] * dist.get_world_size()
    dist.all_gather_object(writers, writer)
    index = sum(1 for w in writers[: dist.get_rank()] if w)
    file_name = f"model-{index + 1:05d}-of-{sum(map(bool, writers)):05d}.safetensors"
    if writer:
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        if progress:
            progress(f"wrote {file_name} ({len(tensors)} tensors)")
    names = list(tensors) if writer else []
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (file_name, names))
    if dist.get_rank() == 0:
        weight_map = {n: fname for fname, tnames in gathered for n in tnames}  # type: ignore[misc]
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        cfg = hf_config if hf_config is not None else read_hf_config(source_dir)  # type: ignore[arg-type]
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        if source_dir is not None:
            for side in Path(source_dir).iterdir():
                if side.is_file() and side.name != "config.json" and not is_weight_file(side.name):
                    shutil.copy(side, out / side.name)
    dist.barrier()
    return out
