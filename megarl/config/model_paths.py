"""One resolver for every model path key: a local directory, or a hub id found in the HF cache.

``build_model`` and the tokenizer read files from a directory (vLLM alone would resolve a hub
id), so before any engine starts every key of :data:`MODEL_PATH_KEYS` becomes the local
directory it names: an existing directory, else the snapshot ``refs/main`` points to in the HF
cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``), else an error
naming the key. Never the network: every rank gets the same answer; fetch a model first
(``hf download org/name``). Remote URLs (``s3://``) are left to validation.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megarl.config.model_source import is_remote, looks_like_hub_id

__all__ = ["MODEL_PATH_KEYS", "hf_hub_cache", "resolve_model_path", "resolve_model_paths"]

MODEL_PATH_KEYS = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "critic.model.path",
    "critic.model.tokenizer_path",
    "reward_model.model.path",
)
"""Every config key that names a model (or tokenizer) directory."""


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache directory, as ``huggingface_hub`` finds it from the environment."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def resolve_model_path(path: str, key: str) -> str:
    """The local directory ``path`` (the value of config key ``key``) names.

    Raises ``ValueError`` with a one-line message naming ``key`` and ``path`` when it names none.
    """
    local = Path(path).expanduser()
    if local.is_dir():
        return str(local.resolve())
    if looks_like_hub_id(path):
        repo = hf_hub_cache() / f"models--{path.replace('/', '--')}"
        ref = repo / "refs" / "main"
        snapshot = repo / "snapshots" / ref.read_text().strip() if ref.is_file() else None
        if snapshot is not None and snapshot.is_dir():
            return str(snapshot)
        raise ValueError(
            f"{key}={path!r} is a hub id not in the Hugging Face cache ({repo} has no "
            f"refs/main snapshot); megarl does not download: run `hf download {path}` first "
            "or set the key to a local directory"
        )
    problem = "is not a directory" if local.exists() else "does not exist"
    raise ValueError(f"{key}={path!r} {problem}")


def resolve_model_paths(cfg: Any) -> list[str]:
    """Replace every set key of :data:`MODEL_PATH_KEYS` in ``cfg`` by its local directory
    (keys of a disabled critic or reward model are left alone).

    Returns one error line per key that names no local directory (those keys are left as they
    were). Remote URLs are skipped. Idempotent: a resolved directory resolves to itself.
    """
    from megarl.config.batch_plan import critic_enabled

    unused = {"critic": not critic_enabled(cfg), "reward_model": not cfg.reward_model.enable}
    errors = []
    for key in MODEL_PATH_KEYS:
        if unused.get(key.split(".")[0]):
            continue  # a path of a disabled model is never read
        *parents, name = key.split(".")
        owner = cfg
        for part in parents:
            owner = getattr(owner, part)
        value = getattr(owner, name)
        if not value or is_remote(value):
            continue
        try:
            setattr(owner, name, resolve_model_path(value, key))
        except ValueError as exc:
            errors.append(str(exc))
    return errors
