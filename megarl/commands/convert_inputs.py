"""Input checks of ``megarl convert`` (:mod:`megarl.commands.convert`): cheap, in the launching
process, before any worker starts. Each problem is one :class:`ConvertError` naming the flag,
path, architecture or size that is wrong."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pickle
import struct
from pathlib import Path

from megarl.checkpoint.meta import META_FILE


class ConvertError(Exception):
    """A problem with the user's inputs, reported as one ``error: ...`` line (exit 2)."""


def check_inputs(args: argparse.Namespace) -> None:
    """Raise :class:`ConvertError` naming the path, architecture or size that is wrong."""
    for name in ("tp", "pp", "ep", "etp"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConvertError(f"--{name} must be >= 1, got {value}")
    if args.vpp is not None and (args.vpp < 1 or (args.vpp > 1 and args.pp < 2)):
        raise ConvertError(f"--vpp {args.vpp} needs --pp >= 2 (and --vpp >= 1)")
    if args.num_sequences < 1 or args.seq_len < 2:
        raise ConvertError("--num-sequences must be >= 1 and --seq-len >= 2")
    if args.command == "hf-to-megatron":
        _check_hf_dir(args.hf_path, "--hf-path", need_weights=True)
        _check_out(args.out, args.force)
        cfg = _read_hf(Path(args.hf_path) / "config.json")
        where = Path(args.hf_path) / "config.json"
    else:
        meta = _check_ckpt(args.ckpt)
        if args.hf_config is not None:
            _check_hf_dir(args.hf_config, "--hf-config", need_weights=False)
            cfg = _read_hf(Path(args.hf_config) / "config.json")
            where = Path(args.hf_config) / "config.json"
        elif "hf_config" in meta:
            cfg, where = meta["hf_config"], Path(args.ckpt) / META_FILE
        else:
            raise ConvertError(
                f"--ckpt {args.ckpt} has no HF config in megarl_meta.json; pass --hf-config DIR"
            )
        if args.command == "verify":
            _check_hf_dir(args.hf_path, "--hf-path", need_weights=True)
        else:
            _check_out(args.out, args.force)
    dims = _checked_dims(cfg, args.tp, where)
    if args.command == "verify":
        hf_where = Path(args.hf_path) / "config.json"
        hf_dims = _checked_dims(_read_hf(hf_where), args.tp, hf_where)
        if hf_dims != dims:
            diff = {
                f.name: (getattr(dims, f.name), getattr(hf_dims, f.name))
                for f in dataclasses.fields(dims)
                if getattr(dims, f.name) != getattr(hf_dims, f.name)
            }
            raise ConvertError(
                f"--hf-path {args.hf_path} is a different model from --ckpt {args.ckpt} "
                f"(checkpoint vs HF: {diff})"
            )
    _check_layout(dims, args, where)


def _checked_dims(cfg: dict, tp: int, where: Path):
    from megarl.config.model_dims import ModelDims, UnsupportedArchitectureError

    try:
        return ModelDims.from_hf_config(cfg, tp_size=tp)
    except UnsupportedArchitectureError as exc:
        raise ConvertError(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ConvertError(f"{where}: {exc}") from None


def _check_hf_dir(path: str, flag: str, *, need_weights: bool) -> None:
    p = Path(path)
    if not p.exists():
        raise ConvertError(f"{flag} {path} does not exist")
    if not p.is_dir():
        raise ConvertError(f"{flag} {path} is not a directory")
    if not (p / "config.json").is_file():
        raise ConvertError(f"{flag} {path} has no config.json (not a Hugging Face model directory)")
    if need_weights:
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"{flag} {path} has no *.safetensors files")
        for f in files:
            _check_safetensors(f, flag)


def _check_safetensors(path: Path, flag: str) -> None:
    """Refuse a ``.safetensors`` file whose header is unreadable or promises more bytes than the
    file holds (truncated, or not a safetensors file at all)."""
    safetensors_header(path, flag)


def safetensors_header(path: Path, flag: str = "") -> dict:
    """The tensor entries of a ``.safetensors`` header (``__metadata__`` left out), checked
    against the file's size; :class:`ConvertError` (prefixed by ``flag``) when it is not one."""
    where = f"{flag}: {path}" if flag else str(path)
    size = path.stat().st_size
    with path.open("rb") as fh:
        prefix = fh.read(8)
        n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        header = None
        if 2 <= n <= size - 8:
            try:
                header = json.loads(fh.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError):
                header = None
    if not isinstance(header, dict):
        raise ConvertError(f"{where} is not a safetensors file (no valid header)")
    header.pop("__metadata__", None)
    ends = [
        entry.get("data_offsets", [0, 0])[-1]
        for entry in header.values()
        if isinstance(entry, dict)
    ]
    need = max((e for e in ends if isinstance(e, int)), default=0)
    if need > size - 8 - n:
        raise ConvertError(
            f"{where} is truncated (its header lists {need} bytes of tensors, "
            f"the file holds {size - 8 - n})"
        )
    return header


def _check_out(path: str, force: bool) -> None:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConvertError(f"--out {path} exists and is not a directory")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise ConvertError(f"--out {path} is not empty (pass --force to write into it)")


def _check_ckpt(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConvertError(f"--ckpt {path} does not exist")
    if not (p / "metadata.json").is_file():
        raise ConvertError(
            f"--ckpt {path} is not a Megatron distributed checkpoint (no metadata.json)"
        )
    _check_shards(p)
    return _read_json(p / META_FILE) if (p / META_FILE).is_file() else {}


def _check_shards(ckpt: Path) -> None:
    """Refuse a checkpoint whose torch-dist index is unreadable or names bytes past the end of a
    ``.distcp`` shard (a truncated or missing shard)."""
    if not (ckpt / ".metadata").is_file():
        return  # not the torch_dist format: Megatron's loader judges it
    try:
        need = shard_extents(ckpt / ".metadata")
    except Exception as exc:  # noqa: BLE001 - any failure here means an unreadable index
        raise ConvertError(f"--ckpt {ckpt}: cannot read its index .metadata ({exc!r})") from None
    for name, end in sorted(need.items()):
        shard = ckpt / name
        if not shard.is_file():
            raise ConvertError(f"--ckpt {ckpt}: shard {name} is missing")
        if shard.stat().st_size < end:
            raise ConvertError(
                f"--ckpt {ckpt}: shard {name} is truncated ({shard.stat().st_size} bytes, "
                f"the index needs {end})"
            )


def shard_extents(index: Path) -> dict[str, int]:
    """For each shard file a torch-dist index (``.metadata``) names, the end of the last byte
    range it reads there. Read without importing torch (which takes seconds the launcher
    would spend before every conversion) and without executing anything from the file."""
    with index.open("rb") as fh:
        metadata = _IndexUnpickler(fh).load()
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    return need


class _Record:
    """Stand-in for a class named in a torch-dist index: keeps the pickled state as attributes
    (constructor arguments as ``args``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args = args

    def __setstate__(self, state: object) -> None:
        parts = state if isinstance(state, tuple) else (state,)  # (dict, slots) or dict
        for part in parts:
            if isinstance(part, dict):
                self.__dict__.update(part)


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a torch-dist index into :class:`_Record` stand-ins; a name outside ``torch``
    is refused, so nothing the file names is imported or called."""

    def find_class(self, module: str, name: str) -> type:
        if module != "torch" and not module.startswith("torch."):
            raise pickle.UnpicklingError(f"{module}.{name} does not belong in a torch-dist index")
        return _record_type(module, name)


@functools.cache
def _record_type(module: str, name: str) -> type:
    return type(name, (_Record,), {"__module__": module})


def _read_hf(path: Path) -> dict:
    from megarl.config.model_dims import read_hf_config

    try:
        return read_hf_config(path)
    except (OSError, ValueError) as exc:
        raise ConvertError(f"cannot read {path}: {exc}") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConvertError(f"cannot read {path}: {exc}") from None


def conversion_layout(args: argparse.Namespace):
    """The :class:`~megarl.parallel.layout.ParallelLayout` of ``--tp --pp --vpp --ep --etp`` and
    the layer split's flags (``--ep``/``--etp`` absent: 1 and TP; the split's: even)."""
    from megarl.parallel.layout import ParallelLayout

    return ParallelLayout(
        args.tp,
        args.pp,
        args.vpp,
        expert_model_parallel_size=getattr(args, "ep", 1),
        expert_tensor_parallel_size=getattr(args, "etp", None),
        num_layers_in_first_pipeline_stage=getattr(
            args, "num_layers_in_first_pipeline_stage", None
        ),
        num_layers_in_last_pipeline_stage=getattr(args, "num_layers_in_last_pipeline_stage", None),
        account_for_embedding_in_pipeline_split=getattr(
            args, "account_for_embedding_in_pipeline_split", False
        ),
        account_for_loss_in_pipeline_split=getattr(
            args, "account_for_loss_in_pipeline_split", False
        ),
    )


SPLIT_FLAGS = {
    "first": "--decoder-first-pipeline-num-layers",
    "last": "--decoder-last-pipeline-num-layers",
    "embedding": "--account-for-embedding-in-pipeline-split",
    "loss": "--account-for-loss-in-pipeline-split",
}
"""The layer split's flags (Megatron-LM's names), by :data:`megarl.parallel.layout.SPLIT_NAMES`
placeholder."""


def _check_layout(dims, args: argparse.Namespace, where: Path) -> None:
    """Megatron's rule (:func:`megarl.parallel.layout.shape_layout_problems`), named by flag."""
    from megarl.parallel.layout import shape_layout_problems

    layout = conversion_layout(args)
    problems = shape_layout_problems(layout, dims.known())
    if problems:
        text = problems[0].describe(
            tp=f"--tp {args.tp}",
            pp=f"--pp {args.pp}",
            vpp=f"--vpp {args.vpp}",
            **SPLIT_FLAGS,
            ep=f"--ep {layout.ep}",
            etp=f"--etp {layout.etp}"
            if layout.expert_tensor_parallel_size is not None
            else f"--etp (= --tp {args.tp})",
        )
        raise ConvertError(f"{text} of {where}")
