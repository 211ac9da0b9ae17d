"""The actor's tokenizer, as every part of a run loads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def trusts_remote_code(cfg: Any) -> bool:
    """transformers' and vLLM's ``trust_remote_code`` for the run:
    ``actor_rollout_ref.model.trust_remote_code`` or ``data.trust_remote_code`` (verl loads the
    data's tokenizer with the latter; megarl tokenizes the data with the actor's tokenizer)."""
    return bool(cfg.actor_rollout_ref.model.trust_remote_code or cfg.data.trust_remote_code)


def actor_tokenizer_path(cfg: Any) -> Path:
    """``actor_rollout_ref.model.tokenizer_path``, else ``model.path`` (``~`` expanded)."""
    model = cfg.actor_rollout_ref.model
    return Path(model.tokenizer_path or model.path).expanduser()


def load_actor_tokenizer(cfg: Any):
    """The HF tokenizer at :func:`actor_tokenizer_path`, with :func:`trusts_remote_code`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(actor_tokenizer_path(cfg)), trust_remote_code=trusts_remote_code(cfg)
    )


def load_image_processor(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The image processor of the model at ``path`` (its ``preprocessor_config.json``), or None
    for a text-only model. Loaded by itself: transformers 5 builds the whole processor
    (``AutoProcessor``) only with torchvision installed, for its video processor."""
    from transformers import AutoImageProcessor

    if not (Path(path).expanduser() / "preprocessor_config.json").is_file():
        return None
    return AutoImageProcessor.from_pretrained(
        str(Path(path).expanduser()), trust_remote_code=trust_remote_code
    )


def image_options(cfg: Any) -> dict[str, Any]:
    """:meth:`~megarl.data.PromptDataset.from_config`'s image arguments for the run: a
    vision-language actor's image processor and ``rollout.limit_images``; none for a text model
    (an image row is then refused)."""
    from megarl.config.vision_language_checks import vision_language_model_type

    model_path = cfg.actor_rollout_ref.model.path
    if vision_language_model_type(model_path) is None:
        return {}
    return {
        "image_processor": load_image_processor(model_path, trusts_remote_code(cfg)),
        "limit_images": cfg.actor_rollout_ref.rollout.limit_images,
    }
