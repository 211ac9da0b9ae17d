"""Where validation finds a model's shape: the HF ``config.json``, else ``*.model.architecture``.

Only the JSON file is read (no transformers import), so validation stays fast and offline. The
shape is the partial form of :class:`~megarl.config.model_dims.ModelDims` (the dict
:func:`~megarl.config.model_dims.known_dims` returns), with the place it came from for messages.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.config.model_dims import known_dims, read_hf_config
from megarl.config.schema_model import ArchitectureConfig, ModelConfig


@dataclass(frozen=True)
class ModelShape:
    """A partial :class:`~megarl.config.model_dims.ModelDims` and where it was read."""

    source: str
    """``path/config.json`` or the dotted key of the architecture section."""
    dims: dict[str, Any] = field(default_factory=dict)
    """Known ModelDims fields (see :func:`~megarl.config.model_dims.known_dims`)."""

    def get(self, name: str) -> Any:
        """A ModelDims field, or None when unknown."""
        return self.dims.get(name)


def is_remote(path: str) -> bool:
    """True for URLs such as ``hdfs://...`` or ``s3://...`` that cannot be checked locally."""
    return "://" in path


def looks_like_hub_id(path: str) -> bool:
    """True for ``org/name`` where neither ``org/name`` nor ``org`` exists locally."""
    parts = path.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not path.startswith((".", "~"))
        and not Path(parts[0]).exists()
    )


def find_config_json(path: str) -> Path | None:
    """``config.json`` of a local model directory, or of a hub id in the local HF cache."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local / "config.json"
    if looks_like_hub_id(path):
        hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
            os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
        )
        snapshots = Path(hub) / f"models--{path.replace('/', '--')}" / "snapshots"
        found = sorted(snapshots.glob("*/config.json"))
        if found:
            return found[-1]
    return None


def architecture_dims(arch: ArchitectureConfig) -> dict[str, Any]:
    """The architecture section as a partial ModelDims (parsed as the HF config it mirrors)."""
    hf = {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)}
    declared = {k: v for k, v in hf.items() if v is not None}
    if "architecture" in declared:
        declared["architectures"] = [declared.pop("architecture")]
    dims = known_dims(declared)
    if arch.num_key_value_heads is None:
        dims.pop("num_query_groups", None)  # unknown here, not "equal to the heads"
    return dims


def resolve_model_shape(
    model: ModelConfig, key: str, check_paths: bool
) -> tuple[ModelShape | None, list[str], list[str]]:
    """The shape of the model configured at ``key`` (e.g. ``actor_rollout_ref.model``).

    Returns ``(shape or None, errors, warnings)``. A ``config.json`` found locally wins and the
    architecture section must agree with it; otherwise the architecture section is used.
    """
    errors: list[str] = []
    warnings: list[str] = []
    arch_key = f"{key}.architecture"
    declared = {
        f.name: getattr(model.architecture, f.name)
        for f in dataclasses.fields(ArchitectureConfig)
        if getattr(model.architecture, f.name) is not None
    }
    for name, value in declared.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if value < 0 or (value == 0 and name != "num_experts"):
            errors.append(f"{arch_key}.{name} must be positive, got {value}")
    if errors:
        return None, errors, warnings
    path = model.path
    if path is None:
        return None, errors, warnings  # "path is required" is reported by the validator
    config_json = None if is_remote(path) else find_config_json(path)
    if config_json is not None and not config_json.is_file():
        errors.append(f"{key}.path={path!r} is a directory without a config.json")
        return None, errors, warnings
    if config_json is not None:
        try:
            hf = read_hf_config(config_json)
        except (OSError, ValueError) as exc:
            errors.append(f"{key}.path={path!r}: cannot read {config_json}: {exc}")
            return None, errors, warnings
        hf.update(model.override_config)
        from_file = known_dims(hf)
        from_section = architecture_dims(model.architecture)
        for name, value in declared.items():
            dims_name = _DIMS_NAME.get(name, name)
            actual = from_file.get(dims_name)
            if actual is not None and actual != from_section.get(dims_name, value):
                errors.append(
                    f"{arch_key}.{name}={value} disagrees with {config_json} ({name}={actual}); "
                    f"fix the architecture section or {key}.path"
                )
        return ModelShape(str(config_json), from_file), errors, warnings
    if is_remote(path):
        where = "a remote path"
    elif looks_like_hub_id(path):
        where = "neither a local directory nor in the Hugging Face cache (a hub id?)"
    else:
        where = "not found locally"
    if check_paths and not is_remote(path) and not looks_like_hub_id(path):
        errors.append(f"{key}.path={path!r} does not exist")
    if declared:
        if not check_paths:
            warnings.append(
                f"{key}.path={path!r} is {where}; checking the layout against {arch_key}"
            )
        return ModelShape(arch_key, architecture_dims(model.architecture)), errors, warnings
    warnings.append(
        f"{key}.path={path!r} is {where} and {arch_key} is not set: attention heads and layers "
        "were not checked against the parallel layout"
    )
    return None, errors, warnings


_DIMS_NAME = {
    "num_key_value_heads": "num_query_groups",
    "num_hidden_layers": "num_layers",
    "intermediate_size": "ffn_hidden_size",
}
"""Architecture-section (HF) names that differ from ModelDims field names."""
