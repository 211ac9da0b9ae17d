"""The image rows of a prompt dataset: their messages, token counts and model inputs (issue 58).

:class:`ImageRows` holds what a :class:`~megarl.data.dataset.PromptDataset` needs of its rows'
images: checked and counted once, up front (every image decoded, so a bad one is refused at
load in one line naming the file, row and image), and turned into pixels again when a sample is
read (the pixels of a whole dataset would not fit in memory; the encoded bytes do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megarl.data.images import (
    VLLM_IMAGE_LIMIT,
    ImageError,
    build_image_messages,
    fetch_image,
    image_processor_kwargs,
    load_image,
    merged_token_count,
    widen_image_placeholders,
)
from megarl.data.tokenize import as_messages

__all__ = ["ImageRows", "row_images"]

DEFAULT_IMAGE_TOKEN = "<|image_pad|>"
"""Qwen2-VL's image placeholder token (the processor's ``image_token``)."""


def row_images(row: dict[str, Any], image_key: str, video_key: str, where: str) -> list[Any]:
    """The ``image_key`` cell of a row as a list (empty: a text prompt). A non-empty
    ``video_key`` cell is refused (videos are not built)."""
    if row.get(video_key):
        raise ImageError(f"{where}: the row has videos (column {video_key!r}, data.video_key); "
                         "videos are not built (images only, issue 58)")  # fmt: skip
    cell = row.get(image_key)
    if cell is None:
        return []
    if isinstance(cell, dict | str | bytes) or not isinstance(cell, Sequence):
        return [cell]  # one image, not in a list
    return list(cell)


class ImageRows:
    """The images of the rows that have them, with the image processor and its options.

    ``mm_processor_kwargs``: ``data.mm_processor_kwargs`` (image processor options);
    ``limit_images``: the most images a prompt may hold (``rollout.limit_images``; None: vLLM's
    999).
    """

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        *,
        mm_processor_kwargs: dict[str, Any] | None = None,
        limit_images: int | None = None,
    ) -> None:
        self.image_processor = image_processor
        self.kwargs = image_processor_kwargs(mm_processor_kwargs, image_processor)
        """What each call of the image processor gets besides the images."""
        self.limit = VLLM_IMAGE_LIMIT if limit_images is None else limit_images
        self.limit_key = ("vLLM's default limit" if limit_images is None
                          else "actor_rollout_ref.rollout.limit_images")  # fmt: skip
        self.image_token = getattr(tokenizer, "image_token", None) or DEFAULT_IMAGE_TOKEN
        self.merge_size = int(image_processor.merge_size)
        self.patch_size = int(image_processor.patch_size)
        self.cells: dict[int, list[Any]] = {}
        """Row -> its images as stored (encoded bytes, paths)."""
        self.counts: dict[int, list[int]] = {}
        """Row -> each image's merged token count."""

    def fetched(self, cells: Sequence[Any], where: str) -> list[Any]:
        """The images of one row, decoded and resized as qwen_vl_utils' ``fetch_image``."""
        out = []
        for k, cell in enumerate(cells):
            image = load_image(cell, f"{where} image {k}")
            options = cell if isinstance(cell, dict) else {}
            try:
                out.append(fetch_image(image, options, self.patch_size))
            except ImageError as exc:
                raise ImageError(f"{where} image {k}: {exc}") from exc
        return out

    def pixels(self, images: list[Any]) -> dict[str, Any]:
        """``pixel_values [patches, C·T·P·P]`` and ``image_grid_thw [images, 3]`` of the image
        processor (with ``data.mm_processor_kwargs``)."""
        out = self.image_processor(images=images, return_tensors="pt", **self.kwargs)
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def token_counts(self, images: list[Any]) -> list[int]:
        """Each image's merged token count, as the image processor's grid gives it: from its
        patch count when the options leave its resize alone (no pixels made), else from the
        grids of a call."""
        size = self.kwargs.get("size") or self.image_processor.size
        if "do_resize" in self.kwargs or not hasattr(
            self.image_processor, "get_number_of_image_patches"
        ):
            grids = self.pixels(images)["image_grid_thw"].tolist()
            return [merged_token_count(g, self.merge_size) for g in grids]
        limits = {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}
        return [
            self.image_processor.get_number_of_image_patches(im.height, im.width, limits)
            // self.merge_size**2
            for im in images
        ]

    def add(self, index: int, prompt: Any, cells: list[Any], where: str) -> list[dict[str, Any]]:
        """Check row ``index``'s images (each decoded) and remember their token counts; returns
        the prompt's messages with an image content item at each ``<image>``."""
        if len(cells) > self.limit:
            raise ImageError(f"{where}: {len(cells)} images, more than the {self.limit} a prompt "
                             f"may hold ({self.limit_key})")  # fmt: skip
        messages = build_image_messages(as_messages(prompt, where), len(cells), where)
        self.cells[index] = cells
        self.counts[index] = self.token_counts(self.fetched(cells, where))
        return messages

    def widen(self, index: int, text: str, where: str) -> str:
        """The rendered text of row ``index`` with each image placeholder widened to the image's
        merged token count."""
        return widen_image_placeholders(text, self.counts[index], self.image_token, where)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep the image rows among ``rows`` (old indices), renumbered by their place there."""
        self.cells = {new: self.cells[old] for new, old in enumerate(rows) if old in self.cells}
        self.counts = {new: self.counts[old] for new, old in enumerate(rows) if old in self.counts}

    def inputs(self, index: int, where: str) -> tuple[list[Any], dict[str, Any]] | None:
        """Row ``index``'s images for vLLM (PIL, fetched) and the model's ``pixel_values`` and
        ``image_grid_thw``; None for a text row."""
        if index not in self.cells:
            return None
        images = self.fetched(self.cells[index], where)
        pixels = self.pixels(images)
        counts = [merged_token_count(g, self.merge_size) for g in pixels["image_grid_thw"].tolist()]
        if counts != self.counts[index]:  # the prompt's image tokens would not match the pixels
            raise ImageError(f"{where}: the image processor gives {counts} image tokens, the "
                             f"prompt holds {self.counts[index]}")  # fmt: skip
        return images, pixels
