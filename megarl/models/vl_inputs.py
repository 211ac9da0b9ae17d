"""The language model's inputs of a Qwen2-VL / Qwen2.5-VL prompt: 3-D multimodal RoPE positions
and image embeddings placed at the image tokens.

Pure tensor functions and a batch's images (:class:`ImageRows`; no ``torch.distributed``, no
Megatron, no transformers), on right-padded rows: ``input_ids [b, s]`` with each row's length
in ``lengths [b]``. The images of a batch come in the order their placeholder runs appear, row
by row (the processor's order of ``pixel_values`` and ``image_grid_thw``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def mrope_position_ids(
    input_ids: Tensor,
    lengths: Tensor,
    image_grid_thw: Tensor | None,
    *,
    image_token_id: int,
    spatial_merge_size: int,
) -> Tensor:
    """Qwen2-VL's multimodal RoPE positions ``[3, b, s]`` (temporal, height, width), as
    transformers' ``get_rope_index`` gives them for images.

    A text token's three positions are equal and one past the previous token's; an image of
    grid ``(t, h, w)`` patches is ``t·h·w / merge²`` tokens whose positions are ``p + (frame,
    row, column)`` of the merged grid, ``p`` the position it starts at, and the token after it
    is at ``p + max(h, w) / merge``. Back-to-back images in one run of image tokens each take
    their own grid (transformers would read one run as one image). Positions past a row's
    length continue by one a token (causal attention never reads them).

    Raises ``ValueError`` when the image tokens and ``image_grid_thw`` disagree.
    """
    b, s = input_ids.shape
    out = torch.arange(s, device=input_ids.device).expand(3, b, s).clone()
    grids = [] if image_grid_thw is None else [tuple(g) for g in image_grid_thw.tolist()]
    merge, used = spatial_merge_size, 0
    for row in range(b):
        n = int(lengths[row])
        is_image = (input_ids[row, :n] == image_token_id).int()
        edges = torch.diff(is_image, prepend=is_image.new_zeros(1), append=is_image.new_zeros(1))
        starts, ends = (edges == 1).nonzero()[:, 0].tolist(), (edges == -1).nonzero()[:, 0].tolist()
        at, pos = 0, 0  # next token to place, its position
        for start, end in zip(starts, ends, strict=True):
            out[:, row, at:start] = torch.arange(pos, pos + start - at)
            pos += start - at
            at = start
            while at < end:
                if used == len(grids):
                    raise ValueError(f"row {row}: image tokens past the {len(grids)} images' grids")
                t, h, w = grids[used]
                gh, gw = h // merge, w // merge
                count = t * gh * gw
                if at + count > end:
                    raise ValueError(
                        f"row {row}: image {used} (grid {t}×{h}×{w}) needs {count} image tokens, "
                        f"the run at {at} has {end - at}"
                    )
                frame, height, width = torch.meshgrid(
                    torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"
                )
                grid = torch.stack([frame.flatten(), height.flatten(), width.flatten()])
                out[:, row, at : at + count] = grid.to(out.device) + pos
                pos += max(gh, gw)
                at += count
                used += 1
        out[:, row, at:] = torch.arange(pos, pos + s - at)
    if used != len(grids):
        raise ValueError(f"{len(grids)} image grids but image tokens for {used} of them")
    return out


def place_image_embeddings(
    embeddings: Tensor, input_ids: Tensor, image_embeds: Tensor, *, image_token_id: int
) -> Tensor:
    """``embeddings [s, b, h]`` (Megatron's sequence-first layout) with the image tokens' rows
    replaced by ``image_embeds [n, h]``, filled in the order of the tokens in ``input_ids
    [b, s]`` read row by row (transformers' ``masked_scatter`` on ``[b, s, h]``). Out of place:
    gradients reach both inputs (none to the replaced word embeddings).

    Raises ``ValueError`` when the image token count is not ``n``.
    """
    mask = input_ids == image_token_id
    count = int(mask.sum())
    if count != image_embeds.shape[0]:
        raise ValueError(f"{count} image tokens but {image_embeds.shape[0]} image embeddings")
    rows = embeddings.transpose(0, 1)  # [b, s, h]: the tokens' order
    placed = rows.masked_scatter(mask[..., None], image_embeds.to(rows.dtype))
    return placed.transpose(0, 1).contiguous()


VISION_TOWER = "vision_tower"
"""The first pipeline stage's ``GPTModel`` attribute holding the vision tower (so Megatron's DDP
and optimizer hold its parameters beside the language model's). The language model's weight
mappings skip the parameters under it: they are the tower's, under their HF names."""

IMAGES = "images"
"""The runner extra (:class:`ImageRows`) carrying a batch's images."""


@dataclass
class ImageRows:
    """Every row's images of a batch of sequences: the processor's ``pixel_values`` and
    ``image_grid_thw`` of each row, concatenated in row order, and how many images each row has.

    Indexing with row indices (``rows[idx]``, any order) gives those rows' images in that order,
    which is the order :func:`place_image_embeddings` fills a micro-batch's image tokens in, so a
    :class:`~megarl.models.sequences.SequenceBatch` carries it as an extra (:data:`IMAGES`).
    """

    pixel_values: Tensor
    """``[patches, channels · temporal_patch · patch²]`` every image's patches, row by row."""
    image_grid_thw: Tensor
    """``[images, 3]`` int64: each image's (t, h, w) patch grid, row by row."""
    images_per_row: Tensor
    """``[N]`` int64: images of each row (0 for a text-only row)."""

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, Tensor] | None], width: int) -> ImageRows:
        """From each row's ``multi_modal_inputs`` (``pixel_values``, ``image_grid_thw``; None or
        empty for a text row), ``width`` the patch width (the processor's, for text-only
        batches)."""
        pixels, grids, counts = [], [], []
        for inputs in rows:
            grid = None if not inputs else inputs.get("image_grid_thw")
            if grid is None or len(grid) == 0:
                counts.append(0)
                continue
            grid = torch.as_tensor(grid, dtype=torch.long).reshape(-1, 3)
            patches = torch.as_tensor(inputs["pixel_values"])
            if patches.shape[0] != int(grid.prod(-1).sum()):
                raise ValueError(
                    f"{patches.shape[0]} pixel rows but the grids {grid.tolist()} have "
                    f"{int(grid.prod(-1).sum())} patches"
                )
            pixels.append(patches)
            grids.append(grid)
            counts.append(len(grid))
        return cls(
            torch.cat(pixels) if pixels else torch.zeros(0, width),
            torch.cat(grids) if grids else torch.zeros(0, 3, dtype=torch.long),
            torch.tensor(counts, dtype=torch.long),
        )

    def __len__(self) -> int:
        return int(self.images_per_row.shape[0])

    def __getitem__(self, rows: Tensor) -> ImageRows:
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1).cpu()
        counts = self.images_per_row.cpu()
        first_image = torch.cumsum(counts, 0) - counts
        patches = self.image_grid_thw.cpu().prod(-1)
        first_patch = torch.cumsum(patches, 0) - patches
        images = [torch.arange(int(first_image[r]), int(first_image[r] + counts[r])) for r in rows]
        image_index = torch.cat(images) if images else torch.zeros(0, dtype=torch.long)
        spans = [torch.arange(int(first_patch[i]), int(first_patch[i] + patches[i]))
                 for i in image_index]  # fmt: skip
        patch_index = torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)
        device = self.pixel_values.device
        return ImageRows(
            self.pixel_values[patch_index.to(device)],
            self.image_grid_thw[image_index.to(self.image_grid_thw.device)],
            self.images_per_row[rows.to(self.images_per_row.device)],
        )

    def to(self, device: torch.device | str) -> ImageRows:
        return ImageRows(
            self.pixel_values.to(device),
            self.image_grid_thw.to(device),
            self.images_per_row.to(device),
        )
