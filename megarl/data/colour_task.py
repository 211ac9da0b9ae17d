"""A tiny image task for vision-language runs on CPU (``configs/grpo_tiny_vl_cpu.yaml``): name the
colour of a solid-coloured image.

``write_colour_task(out)`` writes ``train.parquet`` and ``test.parquet`` in verl's image schema
(geo3k's): a ``prompt`` of chat messages whose text holds one ``<image>`` per image, an ``images``
column of ``{"bytes": PNG}`` dicts, ``reward_model.ground_truth`` the colour's name. Most rows hold
one image; every fourth holds two of the same colour. :func:`compute_score` is the task's rule
reward (``custom_reward_function.path=pkg://megarl.data.colour_task``): the share of the colour's
letters the response holds, so a random tiny model's responses already score apart (GRPO needs
that spread to move anything).

    python -m megarl.data.colour_task --out outputs/tiny-vl-data
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 40),
    "purple": (140, 40, 170),
    "orange": (250, 140, 20),
}
"""Colour name -> RGB."""
DATA_SOURCE = "megarl/colour"
SIZES = ((28, 28), (56, 56), (28, 56))
"""(height, width) of the images, in turn: 1, 4 and 2 image tokens at the tiny processor's."""


def _png(rgb: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size[1], size[0]), rgb).save(buf, format="PNG")
    return buf.getvalue()


def colour_rows(count: int, *, offset: int = 0) -> list[dict[str, Any]]:
    """``count`` rows of the task in verl's image schema (row ``i`` of the task from ``offset``)."""
    names = list(COLOURS)
    rows = []
    for i in range(offset, offset + count):
        name = names[i % len(names)]
        images = 2 if i % 4 == 3 else 1
        pictures = [{"bytes": _png(COLOURS[name], SIZES[(i + k) % len(SIZES)])}
                    for k in range(images)]  # fmt: skip
        question = "What colour are these images?" if images == 2 else "What colour is this image?"
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": "<image>" * images + question}],
            "images": pictures,
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": name},
            "extra_info": {"index": i},
        })  # fmt: skip
    return rows


def write_colour_task(out: str | Path, train_size: int = 32, test_size: int = 8) -> Path:
    """Write ``out/train.parquet`` and ``out/test.parquet``; returns ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(colour_rows(train_size)), out / "train.parquet")
    test = colour_rows(test_size, offset=train_size)
    pq.write_table(pa.Table.from_pylist(test), out / "test.parquet")
    return out


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs: Any
) -> float:
    """1 for a response that names the colour; else the share of its distinct letters the
    response holds (lower case)."""
    text = solution_str.lower()
    if ground_truth in text:
        return 1.0
    letters = set(ground_truth)
    return 0.5 * sum(c in text for c in letters) / len(letters)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.data.colour_task")
    parser.add_argument("--out", default="outputs/tiny-vl-data", help="output directory")
    parser.add_argument("--train-size", type=int, default=32)
    parser.add_argument("--test-size", type=int, default=8)
    args = parser.parse_args(argv)
    print(write_colour_task(args.out, args.train_size, args.test_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
