"""The images of a vision-language prompt, as verl 0.9.1's data path prepares them (issue 58).

A row's ``data.image_key`` cell is a list of images, each a ``{"bytes": ...}`` dict (verl's
geo3k files, HF datasets' image struct, whose ``path`` may be set too), an ``{"image": path}``
dict, a path string, or a PIL image. Every ``<image>`` in a message's text becomes one image
content item, in order (verl's ``RLHFDataset._build_messages``); the chat template renders each
as ``<|vision_start|><|image_pad|><|vision_end|>``.

Each image is then fetched as ``qwen_vl_utils.fetch_image`` does it (verl's
``process_vision_info``): converted to RGB (RGBA over white), resized to sides that are
multiples of ``patch_size × 2`` with the image dict's ``min_pixels`` / ``max_pixels`` (default
4 and 16384 merged tokens) or ``resized_height`` / ``resized_width``. Those PIL images are what
vLLM gets as ``multi_modal_data``. The image processor (with ``data.mm_processor_kwargs``)
turns them into ``pixel_values`` and ``image_grid_thw``; each placeholder is widened to its
image's ``t·h·w / merge²`` tokens, as the Qwen2-VL processor does. qwen_vl_utils imports
torchvision, and the processor builds only with torchvision too, so both are re-done here from
their parts.
"""

from __future__ import annotations

import base64
import io
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "IMAGE_PLACEHOLDER",
    "VLLM_IMAGE_LIMIT",
    "build_image_messages",
    "fetch_image",
    "image_processor_kwargs",
    "load_image",
    "merged_token_count",
    "smart_resize",
    "widen_image_placeholders",
]

IMAGE_PLACEHOLDER = "<image>"
"""What marks an image's place in a message's text (verl's schema)."""
VLLM_IMAGE_LIMIT = 999
"""vLLM's images a prompt when ``limit_mm_per_prompt`` does not say (``rollout.limit_images``
null)."""
SPATIAL_MERGE = 2
"""qwen_vl_utils' merge of 2×2 patches into one token, in its resize factor."""
MIN_TOKENS, MAX_TOKENS = 4, 16384
"""qwen_vl_utils' default smallest and largest image, in merged tokens."""
MAX_RATIO = 200
"""The longest side at most 200 times the shortest (qwen_vl_utils and the image processor)."""
_MODEL_KWARGS = ("patch_size", "merge_size", "temporal_patch_size")
_OWN_KWARGS = ("return_tensors", "device", "data_format", "input_data_format")
_PLACEHOLDERS = re.compile("(<image>|<video>|<audio>)")


class ImageError(ValueError):
    """An image of a row cannot be used (raised as ``DataError`` by the dataset)."""


def load_image(item: Any, where: str) -> Any:
    """The PIL image of one ``data.image_key`` entry, decoded in full (bytes win over a path, as
    verl; a relative path is read from the current directory, as verl).

    Raises :class:`ImageError` naming ``where`` (``file row N image K``) when the bytes do not
    decode, the file is missing, or the entry is none of the accepted forms.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        return item
    source: Any = item
    if isinstance(item, dict):
        if item.get("bytes") is not None:
            source = item["bytes"]
        elif item.get("image") is not None:
            source = item["image"]
        elif item.get("path") is not None:
            source = item["path"]
        else:
            raise ImageError(f"{where}: an image dict needs 'bytes', 'image' or 'path', got "
                             f"keys {sorted(item)}")  # fmt: skip
        if isinstance(source, Image.Image):
            return source
    if isinstance(source, bytes | bytearray):
        data, name = bytes(source), "its bytes"
    elif isinstance(source, str):
        if source.startswith(("http://", "https://")):
            raise ImageError(f"{where}: {source!r}: images by URL are not fetched (download them)")
        if source.startswith("data:image") and "base64," in source:
            data, name = base64.b64decode(source.split("base64,", 1)[1]), "its base64 data"
        else:
            path = Path(source.removeprefix("file://")).expanduser()
            if not path.is_file():
                raise ImageError(f"{where}: image file {source!r} does not exist"
                                 + ("" if path.is_absolute() else " (read from the current directory)"))  # fmt: skip
            data, name = path.read_bytes(), repr(source)
    else:
        raise ImageError(f"{where}: an image must be bytes, a path or a dict with 'bytes' or "
                         f"'image', got {type(source).__name__}")  # fmt: skip
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except UnidentifiedImageError as exc:
        raise ImageError(f"{where}: cannot decode {name} as an image (not a format PIL "
                         "reads)") from exc  # fmt: skip
    except Exception as exc:  # truncated or corrupt data: PIL's reason
        raise ImageError(f"{where}: cannot decode {name} as an image ({exc})") from exc
    return image


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> tuple[int, int]:  # fmt: skip
    """qwen_vl_utils' resize target: sides multiples of ``factor``, the area within
    ``[min_pixels, max_pixels]`` (default 4 and 16384 tokens of ``factor²``), aspect kept.

    Raises :class:`ImageError` when one side is over 200 times the other."""
    max_pixels = MAX_TOKENS * factor**2 if max_pixels is None else max_pixels
    min_pixels = MIN_TOKENS * factor**2 if min_pixels is None else min_pixels
    if max_pixels < min_pixels:
        raise ImageError(f"max_pixels={max_pixels} is below min_pixels={min_pixels}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ImageError(f"a {width}×{height} image: one side is over {MAX_RATIO} times the other")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def fetch_image(image: Any, options: dict[str, Any], patch_size: int) -> Any:
    """``image`` (PIL) as qwen_vl_utils' ``fetch_image`` returns it: RGB (RGBA pasted over white)
    and resized by :func:`smart_resize` with factor ``patch_size × 2`` and the image dict's
    ``min_pixels`` / ``max_pixels`` (or its ``resized_height`` / ``resized_width``)."""
    from PIL import Image

    if image.mode == "RGBA":
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        rgb.paste(image, mask=image.split()[3])
    else:
        rgb = image.convert("RGB")
    factor = patch_size * SPATIAL_MERGE
    if "resized_height" in options and "resized_width" in options:
        height, width = smart_resize(options["resized_height"], options["resized_width"], factor)
    else:
        height, width = smart_resize(rgb.height, rgb.width, factor,
                                     options.get("min_pixels"), options.get("max_pixels"))  # fmt: skip
    # PIL's default filter for RGB (bicubic), as qwen_vl_utils' ``image.resize``
    return rgb.resize((width, height), Image.Resampling.BICUBIC)


def image_processor_kwargs(
    mm_processor_kwargs: dict[str, Any] | None, image_processor: Any
) -> dict:
    """The image processor's call arguments of ``data.mm_processor_kwargs`` (flat, or under
    ``images_kwargs``, as the processor routes them). ``min_pixels`` / ``max_pixels`` become
    the ``size`` they stand for (transformers 5 deprecates them in a call).

    Raises ``ValueError`` naming a key the image processor does not take, a video or audio
    one, or one that would change the model's patching (``patch_size``, ``merge_size``...)."""
    given = dict(mm_processor_kwargs or {})
    nested = given.pop("images_kwargs", None) or {}
    for key in ("videos_kwargs", "audio_kwargs", "text_kwargs"):
        if key in given:
            raise ValueError(f"data.mm_processor_kwargs.{key}: only image processor options are "
                             "built (images, issue 58)")  # fmt: skip
    given.update(nested)
    valid: set[str] = set()
    for cls in type(image_processor).valid_kwargs.__mro__:
        valid |= set(getattr(cls, "__annotations__", {}))
    for key in given:
        if key in _MODEL_KWARGS:
            raise ValueError(f"data.mm_processor_kwargs.{key}: fixed by the model's vision tower "
                             f"({getattr(image_processor, key, None)}); drop it")  # fmt: skip
        if key in _OWN_KWARGS or key not in valid:
            raise ValueError(
                f"data.mm_processor_kwargs.{key}: not an option of the image processor "
                f"{type(image_processor).__name__}; it takes "
                f"{', '.join(sorted(valid - set(_MODEL_KWARGS) - set(_OWN_KWARGS)))}"
            )
    low, high = given.pop("min_pixels", None), given.pop("max_pixels", None)
    if low is not None or high is not None:
        size = dict(given.pop("size", None) or {})
        base = image_processor.size
        size["shortest_edge"] = (
            low if low is not None else size.get("shortest_edge", base.shortest_edge)
        )
        size["longest_edge"] = (
            high if high is not None else size.get("longest_edge", base.longest_edge)
        )
        given["size"] = size
    size = given.get("size")
    if size is not None and not (
        isinstance(size, dict) and {"shortest_edge", "longest_edge"} <= set(size)
    ):
        raise ValueError(f"data.mm_processor_kwargs.size: needs 'shortest_edge' and 'longest_edge' "
                         f"(the least and most pixels an image), got {size!r}")  # fmt: skip
    return given


def build_image_messages(
    messages: list[dict[str, Any]], num_images: int, where: str
) -> list[dict[str, Any]]:
    """``messages`` with every ``<image>`` of a text content split out as an image content item
    (``{"type": "image"}``, the rest ``{"type": "text"}``), as verl's ``_build_messages``.

    Raises :class:`ImageError` when the placeholders and the ``num_images`` images differ in
    number, or a message holds ``<video>`` / ``<audio>`` (not built)."""
    out, used = [], 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            out.append(message)
            continue
        items: list[dict[str, Any]] = []
        for segment in filter(None, _PLACEHOLDERS.split(content)):
            if segment == IMAGE_PLACEHOLDER:
                items.append({"type": "image"})
                used += 1
            elif segment in ("<video>", "<audio>"):
                raise ImageError(f"{where}: a {segment} placeholder; videos and audio are not "
                                 "built (images only, issue 58)")  # fmt: skip
            else:
                items.append({"type": "text", "text": segment})
        out.append({**message, "content": items})
    if used != num_images:
        raise ImageError(f"{where}: {num_images} image(s) but {used} {IMAGE_PLACEHOLDER} "
                         "placeholder(s) in the prompt's messages")  # fmt: skip
    return out


def merged_token_count(grid_thw: Sequence[int], merge_size: int) -> int:
    """Language tokens of one image of patch grid ``(t, h, w)``: ``t·h·w / merge²``."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // merge_size**2


def widen_image_placeholders(text: str, counts: Sequence[int], image_token: str, where: str) -> str:
    """``text`` with its k-th ``image_token`` repeated ``counts[k]`` times (the Qwen2-VL
    processor's expansion). Raises :class:`ImageError` when the numbers differ."""
    parts = text.split(image_token)
    if len(parts) - 1 != len(counts):
        raise ImageError(f"{where}: the rendered prompt has {len(parts) - 1} {image_token} for "
                         f"{len(counts)} image(s) (does the chat template render image items?)")  # fmt: skip
    pieces = [parts[0]]
    for count, rest in zip(counts, parts[1:], strict=True):
        pieces += [image_token * count, rest]
    return "".join(pieces)
