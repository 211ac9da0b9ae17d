"""Which checkpoint a launch resumes from, and whether it fits the configured model.

Plain file work (no torch): ``megarl train``'s pre-flight answers a missing ``resume_from_path``
or a checkpoint of another architecture in one line before any process starts, and every rank
of the trainer runs the same checks before loading.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.checkpoint.layout import (
    CheckpointError,
    latest_complete,
    read_json,
    resolve_resume_path,
)
from megarl.checkpoint.meta import META_FILE
from megarl.config.lora_checks import lora_resume_mismatch

ARCH_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)
"""HF config keys that must agree between a checkpoint and the model it is loaded into."""


def choose_checkpoint(trainer_cfg: Any, run_dir: Path, warn: Callable[[str], None]) -> Path | None:
    """The ``global_step_<N>`` directory to resume from, or None for a fresh start.

    ``trainer.resume_mode``: ``disable`` → None; ``auto`` → the latest complete checkpoint of
    ``run_dir`` (incomplete ones skipped with a warning naming them), None when there is none;
    ``resume_path`` → ``trainer.resume_from_path`` (a step directory or a run directory).
    """
    mode = trainer_cfg.resume_mode
    if mode == "disable":
        return None
    if mode == "resume_path":
        if not trainer_cfg.resume_from_path:
            raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        return resolve_resume_path(trainer_cfg.resume_from_path)
    if mode != "auto":
        raise CheckpointError(f"trainer.resume_mode={mode!r}: choose auto, disable or resume_path")
    return latest_complete(run_dir, warn)


def describe(hf_config: dict, keys: tuple[str, ...]) -> str:
    """``Qwen2ForCausalLM (hidden_size=128, vocab_size=1000)``: architecture and ``keys``."""
    arch = hf_config.get("architectures") or [hf_config.get("model_type", "?")]
    name = arch[0] if isinstance(arch, list) and arch else str(arch)
    shown = [f"{k}={hf_config.get(k)}" for k in keys if k != "architectures"]
    return f"{name} ({', '.join(shown)})" if shown else name


def architecture_mismatch(
    saved: dict, current: dict, *, ckpt: Path, model_key: str, model_path: str
) -> str | None:
    """One line naming both models when ``saved`` and ``current`` HF configs differ in shape."""
    differing = tuple(k for k in ARCH_KEYS if saved.get(k) != current.get(k))
    if not differing:
        return None
    keys = differing if differing != ("architectures",) else ()
    return (
        f"cannot resume: checkpoint {ckpt} holds {describe(saved, keys)} but {model_key}="
        f"{model_path} is {describe(current, keys)}; resume a checkpoint of this model or set "
        "trainer.resume_mode=disable"
    )


def check_model_fits(ckpt: Path, role: str, model_key: str, model_path: str) -> None:
    """Raise ``CheckpointError`` (one line) when ``ckpt/<role>`` holds another architecture."""
    from megarl.config.model_dims import read_hf_config

    saved = read_json(ckpt / role / META_FILE).get("hf_config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{ckpt / role / META_FILE} has no hf_config")
    try:
        current = read_hf_config(Path(model_path).expanduser())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{model_key}={model_path}: {exc}") from None
    problem = architecture_mismatch(
        saved, current, ckpt=ckpt / role, model_key=model_key, model_path=model_path
    )
    if problem is not None:
        raise CheckpointError(problem)


def resume_problem(cfg: Any, run_dir: Path) -> str | None:
    """What would stop ``cfg`` from resuming (for the pre-flight), as one line, or None."""
    try:
        ckpt = choose_checkpoint(cfg.trainer, run_dir, lambda _message: None)
        if ckpt is not None:
            arr = cfg.actor_rollout_ref
            check_model_fits(ckpt, "actor", "actor_rollout_ref.model.path", arr.model.path)
            lora = lora_resume_mismatch(read_json(ckpt / "actor" / META_FILE), arr.model.lora,
                                        ckpt=ckpt / "actor")  # fmt: skip
            if lora is not None:
                raise CheckpointError(lora)
            check_checkpoint_files(ckpt)
    except CheckpointError as exc:
        return str(exc)
    return None


def check_checkpoint_files(ckpt: Path) -> None:
    """The files a resume reads are there and whole: the JSON files parse, and every
    ``.distcp`` shard is long enough for each tensor the metadata places in it (a truncated
    copy is named here, not as a flattened torch traceback on every rank). Raises
    ``CheckpointError`` naming the file."""
    from torch.distributed.checkpoint import FileSystemReader

    read_json(ckpt / "trainer_state.json")
    for role in sorted(p for p in ckpt.iterdir() if (p / META_FILE).is_file()):
        read_json(role / META_FILE)
        try:
            metadata = FileSystemReader(str(role)).read_metadata()
        except Exception as exc:  # noqa: BLE001 -- torch raises several kinds here
            raise CheckpointError(f"cannot read {role / '.metadata'}: {exc}") from None
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        for name, end in sorted(needed.items()):
            shard = role / name
            size = shard.stat().st_size if shard.is_file() else -1
            if size < 0:
                raise CheckpointError(f"checkpoint shard {shard} is missing")
            if size < end:
                raise CheckpointError(
                    f"checkpoint shard {shard} is truncated ({size} bytes, the metadata needs {end})"
                )
