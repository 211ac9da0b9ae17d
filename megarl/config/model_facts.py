"""The model shape validation needs: from the HF ``config.json``, else from ``*.model.architecture``.

Only the JSON file is read (no transformers import), so validation stays fast and offline.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from megarl.config.schema import ArchitectureConfig, ModelConfig

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass
class ModelFacts:
    """What is known about a model's shape, and where it came from (for messages)."""

    source: str
    """``path/config.json`` or the dotted key of the architecture section."""
    num_attention_heads: int | None = None
    """Query heads."""
    num_key_value_heads: int | None = None
    """KV heads (query groups)."""
    num_hidden_layers: int | None = None
    """Transformer layers."""
    hidden_size: int | None = None
    """Hidden width."""
    vocab_size: int | None = None
    """Vocabulary size."""
    max_position_embeddings: int | None = None
    """Longest supported sequence."""
    num_experts: int | None = None
    """Routed experts (None or 0: dense)."""
    head_dim: int | None = None
    """Channels per attention head (HF head_dim, else hidden_size / num_attention_heads)."""

    def __post_init__(self) -> None:
        if self.head_dim is None and self.hidden_size and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads


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


def read_hf_config(config_json: Path) -> dict:
    """The HF config as a dict; the text part of multimodal configs is merged on top."""
    data = json.loads(config_json.read_text())
    text = data.get("text_config")
    if isinstance(text, dict) and "num_attention_heads" not in data:
        data = {**data, **text}
    return data


def facts_from_hf(data: dict, source: str) -> ModelFacts:
    """ModelFacts from an HF config dict (KV heads default to the query heads, as in HF)."""
    heads = data.get("num_attention_heads")
    experts = next((data[k] for k in _EXPERT_KEYS if data.get(k) is not None), None)
    return ModelFacts(
        source=source,
        num_attention_heads=heads,
        num_key_value_heads=data.get("num_key_value_heads") or heads,
        num_hidden_layers=data.get("num_hidden_layers"),
        hidden_size=data.get("hidden_size"),
        vocab_size=data.get("vocab_size"),
        max_position_embeddings=data.get("max_position_embeddings"),
        num_experts=experts or 0,
        head_dim=data.get("head_dim"),
    )


def resolve_model_facts(
    model: ModelConfig, key: str, check_paths: bool
) -> tuple[ModelFacts | None, list[str], list[str]]:
    """Facts about the model configured at ``key`` (e.g. ``actor_rollout_ref.model``).

    Returns ``(facts or None, errors, warnings)``. A ``config.json`` found locally wins and the
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
        facts = facts_from_hf(hf, str(config_json))
        for name, value in declared.items():
            actual = getattr(facts, name)
            if name == "num_experts":
                actual, value = actual or 0, value or 0
            if actual is not None and actual != value:
                errors.append(
                    f"{arch_key}.{name}={value} disagrees with {config_json} ({name}={actual}); "
                    f"fix the architecture section or {key}.path"
                )
        return facts, errors, warnings
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
        return ModelFacts(source=arch_key, **declared), errors, warnings
    warnings.append(
        f"{key}.path={path!r} is {where} and {arch_key} is not set: attention heads and layers "
        "were not checked against the parallel layout"
    )
    return None, errors, warnings
