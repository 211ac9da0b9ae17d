"""The language model's inputs of a Qwen2-VL / Qwen2.5-VL prompt: 3-D multimodal RoPE positions
and image embeddings placed at the image tokens.

Pure tensor functions (no ``torch.distributed``, no Megatron, no transformers), on right-padded
rows: ``input_ids [b, s]`` with each row's length in ``lengths [b]``. The images of a batch come
in the order their placeholder runs appear, row by row (the processor's order of
``pixel_values`` and ``image_grid_thw``).
"""

from __future__ import annotations

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
