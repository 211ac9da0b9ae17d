"""Vision-language prompts (issue 58's data path): verl's geo3k parquet layout (images as bytes)
gives the token ids, pixels, grids and PIL images that transformers' processor pieces give when
applied by hand, and that its ``Qwen2_5_VLProcessor`` gives (verl's call); the overlong filter
counts image tokens; every bad input is one line naming its file and row.

The tiny model's tokenizer and Qwen2-VL image processor (``megarl.models.tiny_vl``), no weights.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from megarl.data import DataError, PromptDataset

INSTRUCTION = "You FIRST think about the reasoning process as an internal monologue."
IMAGE_PAD = "<|image_pad|>"


def _image(height: int, width: int, seed: int, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, channels), np.uint8)
    return Image.fromarray(pixels, mode)


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _geo3k_row(i: int, images: list | None, problem: str) -> dict:
    """A row as verl's examples/data_preprocess/geo3k.py writes it (HF datasets' image struct)."""
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(30 + i)},
        "extra_info": {"split": "train", "index": i, "answer": str(30 + i), "question": problem},
    }


def _write(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """The tiny VL tokenizer and image processor, loaded from disk as a run loads them."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from megarl.data.tokenizer import load_image_processor
    from megarl.models.tiny_vl import TINY_MAX_PIXELS, TINY_MIN_PIXELS, build_vl_tokenizer

    path = tmp_path_factory.mktemp("tiny-vl")
    build_vl_tokenizer(1000).save_pretrained(path)
    Qwen2VLImageProcessorPil(
        min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS
    ).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path), load_image_processor(path)


@pytest.fixture(scope="module")
def qwen_processor(vl):
    """transformers' own ``Qwen2_5_VLProcessor`` (what verl calls), built without its video
    processor: that one needs torchvision, so the class check of that argument is skipped."""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    tok, image_processor = vl
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None)
        return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok,
                                   video_processor=None, chat_template=tok.chat_template)  # fmt: skip


def _by_hand(tok, processor, content: list[dict], fetched: list[Image.Image], **kwargs):
    """Token ids and pixels as the processor's pieces give them: the chat template, the image
    processor, each placeholder widened to t·h·w / merge² tokens, the tokenizer."""
    messages = [{"role": "user", "content": content}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(images=fetched, return_tensors="pt", **kwargs)
    for grid in out["image_grid_thw"]:
        text = text.replace(IMAGE_PAD, "<|placeholder|>" * (int(grid.prod()) // 4), 1)
    ids = tok.encode(text.replace("<|placeholder|>", IMAGE_PAD), add_special_tokens=False)
    return ids, out["pixel_values"], out["image_grid_thw"]


def _by_processor(processor, content: list[dict], fetched: list[Image.Image], **kwargs):
    """Token ids and pixels as verl gets them: ``processor(text=[prompt], images=...)``."""
    messages = [{"role": "user", "content": content}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=fetched, return_tensors="pt", **kwargs)
    return out["input_ids"][0].tolist(), out["pixel_values"], out["image_grid_thw"]


def _same_image(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and a.mode == b.mode and np.array_equal(np.asarray(a), np.asarray(b))


def test_geo3k_layout_gives_the_processors_ids_pixels_and_images(tmp_path, vl, qwen_processor):
    tok, processor = vl
    small, large, rgba = _image(60, 100, 0), _image(150, 200, 1), _image(56, 56, 2, "RGBA")
    rows = [
        _geo3k_row(0, [{"bytes": _png(small), "path": None}], "<image>Find x."),
        _geo3k_row(1, [{"bytes": _png(large)}, {"bytes": _png(rgba)}], "<image>and<image>: y?"),
        _geo3k_row(2, None, "What is 2 + 3?"),  # a text row in the same file
    ]
    ds = PromptDataset(_write(tmp_path / "train.parquet", rows), tok, image_processor=processor)
    assert len(ds) == 3
    # qwen_vl_utils' fetch_image by hand: sides rounded to multiples of 28 (60×100 -> 56×112,
    # 150×200 -> 140×196), RGBA pasted over white
    white = Image.new("RGB", (56, 56), (255, 255, 255))
    white.paste(rgba, mask=rgba.split()[3])
    fetched = [
        [small.resize((112, 56), Image.Resampling.BICUBIC)],
        [large.resize((196, 140), Image.Resampling.BICUBIC), white],
    ]
    image, text = {"type": "image"}, lambda t: {"type": "text", "text": t}
    contents = [
        [image, text(f"Find x. {INSTRUCTION}")],
        [image, text("and"), image, text(f": y? {INSTRUCTION}")],
    ]
    grids = [[[1, 4, 8]], [[1, 6, 8], [1, 4, 4]]]  # 140×196 over 16 tokens: 84×112
    for i in range(2):
        sample = ds[i]
        ids, pixels, grid = _by_hand(tok, processor, contents[i], fetched[i])
        assert sample.prompt_ids == ids
        verl_ids, verl_pixels, verl_grid = _by_processor(qwen_processor, contents[i], fetched[i])
        assert verl_ids == ids and torch.equal(verl_pixels, pixels) and torch.equal(verl_grid, grid)
        assert grid.tolist() == grids[i] == sample.multi_modal_inputs["image_grid_thw"].tolist()
        assert sample.multi_modal_inputs["image_grid_thw"].dtype == torch.int64
        assert torch.equal(sample.multi_modal_inputs["pixel_values"], pixels)
        assert all(_same_image(a, b) for a, b in zip(sample.images, fetched[i], strict=True))
        assert sample.prompt_ids.count(998) == sum(g[1] * g[2] // 4 for g in grids[i])
        assert sample.ground_truth == str(30 + i) and sample.data_source == "hiyouga/geometry3k"
    text_row = ds[2]
    assert text_row.images is None and text_row.multi_modal_inputs is None
    assert text_row.prompt_ids == tok.apply_chat_template(
        [{"role": "user", "content": f"What is 2 + 3? {INSTRUCTION}"}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )  # fmt: skip


def test_paths_and_processor_kwargs(tmp_path, vl, qwen_processor):
    """{"image": path}, a path string and file:// load as the bytes do; mm_processor_kwargs
    (flat or under images_kwargs) reach the image processor as in the processor's call."""
    tok, processor = vl
    picture = _image(150, 200, 3)
    (tmp_path / "a.png").write_bytes(_png(picture))
    path = str(tmp_path / "a.png")
    cells = [[{"bytes": _png(picture)}], [{"image": path}], [path], [f"file://{path}"]]
    files = [  # one file a form: a parquet column holds one type
        _write(tmp_path / f"train{i}.parquet", [_geo3k_row(i, c, "<image>Find x.")])
        for i, c in enumerate(cells)
    ]
    fetched = [picture.resize((196, 140), Image.Resampling.BICUBIC)]
    content = [{"type": "image"}, {"type": "text", "text": f"Find x. {INSTRUCTION}"}]
    cases = [  # (data.mm_processor_kwargs, the image processor's call, its grid)
        ({"max_pixels": 28 * 28 * 4}, {"max_pixels": 28 * 28 * 4}, [1, 2, 4]),  # 28×56
        ({"images_kwargs": {"max_pixels": 28 * 28 * 4}}, {"max_pixels": 28 * 28 * 4}, [1, 2, 4]),
        ({"do_resize": False}, {"do_resize": False}, [1, 10, 14]),  # 140×196 as fetched
    ]
    for kwargs, call, grid in cases:
        ds = PromptDataset(files, tok, image_processor=processor, mm_processor_kwargs=kwargs)
        assert len(ds) == 4
        with warnings.catch_warnings():  # transformers deprecates min/max_pixels in a call
            warnings.simplefilter("ignore", FutureWarning)
            ids, pixels, grids = _by_hand(tok, processor, content, fetched, **call)
            verl = _by_processor(qwen_processor, content, fetched, **kwargs)
        assert verl[0] == ids and torch.equal(verl[1], pixels)
        assert grids.tolist() == [grid]
        for sample in ds:
            assert sample.prompt_ids == ids
            assert torch.equal(sample.multi_modal_inputs["pixel_values"], pixels)


def test_the_overlong_filter_counts_image_tokens(tmp_path, vl):
    """With the text alone both prompts fit; the 12-token image takes one over the limit (a
    28×28 image is 4 tokens: qwen_vl_utils' fetch upscales it to its 4-token least, 56×56)."""
    tok, processor = vl
    rows = [
        _geo3k_row(0, [{"bytes": _png(_image(28, 28, 4))}], "<image>Find x."),  # 4 image tokens
        _geo3k_row(1, [{"bytes": _png(_image(150, 200, 5))}], "<image>Find x."),  # 12
    ]
    file = _write(tmp_path / "train.parquet", rows)
    lengths = [len(s.prompt_ids) for s in PromptDataset(file, tok, image_processor=processor)]
    assert lengths[1] - lengths[0] == 8
    limit = lengths[0] + 5
    ds = PromptDataset(file, tok, image_processor=processor, max_prompt_length=limit,
                       filter_overlong_prompts=True)  # fmt: skip
    assert ds.num_filtered == 1 and len(ds) == 1 and ds[0].ground_truth == "30"
    assert ds[0].multi_modal_inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    with pytest.raises(DataError, match=r"train.parquet row 1: the image prompt has \d+ tokens"):
        PromptDataset(file, tok, image_processor=processor, max_prompt_length=limit,
                      truncation="left")  # fmt: skip


def _bad_cases(tmp_path) -> dict[str, tuple[dict, dict, str]]:
    """name -> (row 1's changes, the dataset's keywords, what the line says)."""
    good = {"bytes": _png(_image(28, 28, 6))}
    gone = tmp_path / "gone.png"
    two = [{"role": "user", "content": "<image><image>"}]
    decode = "row 1 image 0: cannot decode its bytes as an image"
    return {
        "undecodable": ({"images": [{"bytes": b"\x89PNG no"}]}, {}, f"{decode} (not a format PIL"),
        "truncated": ({"images": [{"bytes": good["bytes"][:60]}]}, {}, f"{decode} (image file is"),
        "missing file": ({"images": [{"image": str(gone)}]}, {}, f"image file '{gone}' does not"),
        "missing path": ({"images": ["gone.png"]}, {}, "row 1 image 0: image file 'gone.png' does"),
        "too many": ({"images": [good, good], "prompt": two}, {"limit_images": 1},
                     "row 1: 2 images, more than the 1 a prompt may hold (actor_rollout_ref.rollout"),
        "placeholders": ({"prompt": [{"role": "user", "content": "no image"}]}, {},
                         "row 1: 1 image(s) but 0 <image> placeholder(s)"),
        "video placeholder": ({"prompt": [{"role": "user", "content": "<image><video>"}]}, {},
                              "row 1: a <video> placeholder; videos and audio are not built"),
        "videos": ({"videos": [{"video": "clip.mp4"}]}, {},
                   "row 1: the row has videos (column 'videos', data.video_key)"),
        "text-only model": ({}, {"image_processor": None},
                            "row 0: the row has images (data.image_key='images') but the model"),
        "processor kwarg": ({}, {"mm_processor_kwargs": {"merge_size": 1}},
                            "data.mm_processor_kwargs.merge_size: fixed by the model's vision"),
        "partial size": ({}, {"mm_processor_kwargs": {"size": {"longest_edge": 3136}}},
                         "data.mm_processor_kwargs.size: needs 'shortest_edge' and 'longest_edge'"),
        "unknown kwarg": ({}, {"mm_processor_kwargs": {"fps": 2}},
                          "data.mm_processor_kwargs.fps: not an option of the image processor"),
    }  # fmt: skip


def test_each_bad_input_is_one_line_naming_file_and_row(tmp_path, vl):
    tok, processor = vl
    good = [{"bytes": _png(_image(28, 28, 7))}]
    (tmp_path / "good.png").write_bytes(good[0]["bytes"])
    for name, (change, kwargs, says) in _bad_cases(tmp_path).items():
        first = (
            [str(tmp_path / "good.png")] if name == "missing path" else good
        )  # one type a column
        rows = [_geo3k_row(0, first, "<image>A"), {**_geo3k_row(1, good, "<image>B"), **change}]
        if "videos" not in change:
            rows[1]["videos"] = None
        rows[0]["videos"] = None
        file = _write(tmp_path / "train.parquet", rows)
        with pytest.raises(DataError) as err:
            PromptDataset(file, tok, **{"image_processor": processor, **kwargs})
        message = str(err.value)
        assert says in message and "\n" not in message, (name, message)
        if not message.startswith("data.mm_processor_kwargs"):
            assert message.startswith(f"data.train_files: {file} row "), (name, message)


def test_the_data_keys_validate():
    """data.image_key and data.mm_processor_kwargs are megarl's; data.video_key is refused."""
    from megarl.config import ConfigError, from_dict

    cfg = from_dict({"data": {"image_key": "figures", "mm_processor_kwargs": {"max_pixels": 9}}})
    assert cfg.data.image_key == "figures" and cfg.data.mm_processor_kwargs == {"max_pixels": 9}
    from_dict({"data": {"video_key": "videos"}})  # verl's default: accepted
    with pytest.raises(ConfigError, match="data.video_key.*videos are not built"):
        from_dict({"data": {"video_key": "clips"}})
