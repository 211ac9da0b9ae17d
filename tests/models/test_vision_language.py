"""The Qwen2.5-VL / Qwen2-VL actor (issue 58's model): a Megatron language model with mrope and
transformers' vision tower give transformers' logits on image prompts at TP 1, TP 2 and PP 2.

The pure parts (3-D positions, image placement, the tiny checkpoints) are checked in-process;
every Megatron layout runs in one 2-rank launch (``_vision_language_worker.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.models.vl_inputs import mrope_position_ids, place_image_embeddings
from tests.conftest import run_torchrun

WORKER = Path(__file__).with_name("_vision_language_worker.py")
FAMILIES = {"qwen2_5_vl": 500, "qwen2_vl": 501}
"""Tiny random VL models and their seeds."""
IMAGE_SIZES = ((56, 112), (28, 28))
"""(height, width) of the batch's two images: 2×4 language tokens that cross two of
Qwen2.5-VL's 56-pixel attention windows, and one token (a 2×2 patch grid). The second row's
image comes earlier in its row than the first's: placing by sequence position first would swap
them."""


def _prompts() -> list[list[dict]]:
    """Text, an image, text; an image then text; text alone."""
    image, text = {"type": "image"}, lambda t: {"type": "text", "text": t}
    contents = [[text("count the"), image, text("please")],
                [image, text("what is 2 plus 3 ?")], [text("one two three")]]  # fmt: skip
    return [[{"role": "user", "content": c}] for c in contents]


def _image_batch(path: Path) -> dict:
    """The processor's batch (right-padded), made of its two parts: the image processor's
    pixels and grids, and each placeholder widened to its image's t·h·w / merge² tokens
    (``Qwen2_5_VLProcessor`` itself needs torchvision, absent here)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in IMAGE_SIZES
    ]
    pixels = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    tok = AutoTokenizer.from_pretrained(path)
    texts = [
        tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in _prompts()
    ]
    grids = iter(pixels["image_grid_thw"])
    for i, t in enumerate(texts):
        if "<|image_pad|>" in t:
            texts[i] = t.replace("<|image_pad|>", "<|image_pad|>" * (int(next(grids).prod()) // 4))
    rows = tok(texts, return_tensors="pt", padding=True, padding_side="right")
    return {"input_ids": rows["input_ids"], "attention_mask": rows["attention_mask"],
            "lengths": rows["attention_mask"].sum(1), "pixel_values": pixels["pixel_values"],
            "image_grid_thw": pixels["image_grid_thw"]}  # fmt: skip


@pytest.fixture(scope="module")
def vl_spec(tmp_path_factory) -> dict:
    """The tiny VL models, each with its batch, transformers' logits and 3-D positions."""
    from transformers import AutoModelForImageTextToText

    from megarl.models.tiny_vl import make_tiny_vl_model

    tmp = tmp_path_factory.mktemp("vision_language")
    models = {}
    for family, seed in FAMILIES.items():
        path = make_tiny_vl_model(tmp / family, family, seed=seed)
        batch = _image_batch(path)
        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        types = (ids == hf.config.image_token_id).int()
        with torch.no_grad():
            batch["hf_logits"] = hf(input_ids=ids, attention_mask=mask, mm_token_type_ids=types,
                                    pixel_values=batch["pixel_values"],
                                    image_grid_thw=batch["image_grid_thw"]).logits  # fmt: skip
        batch["hf_position_ids"] = hf.model.get_rope_index(
            ids, types, image_grid_thw=batch["image_grid_thw"], attention_mask=mask
        )[0]
        torch.save(batch, path / "batch.pt")
        models[family] = str(path)
    spec = {"models": models, "tmp": str(tmp)}
    (tmp / "spec.json").write_text(json.dumps(spec))
    return spec


@pytest.fixture(scope="module")
def launched(vl_spec) -> dict:
    run_torchrun(WORKER, 2, [str(Path(vl_spec["tmp"]) / "spec.json")])
    return torch.load(Path(vl_spec["tmp"]) / "results.pt", weights_only=False)


def test_tiny_vl_checkpoints_are_transformers_own(vl_spec):
    """Hub names (``model.layers``, ``visual.``), the vision tokens as the last ids, the chat
    template's placeholders, the image processor's class; both images and the text row."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    for family, path in vl_spec["models"].items():
        config = json.loads((Path(path) / "config.json").read_text())
        assert config["model_type"] == family
        with safe_open(Path(path) / "model.safetensors", "pt") as f:
            prefixes = {k.split(".")[0] + "." + k.split(".")[1] for k in f.keys()}  # noqa: SIM118
        assert prefixes == {"lm_head.weight", "model.embed_tokens", "model.layers", "model.norm",
                            "visual.blocks", "visual.merger", "visual.patch_embed"}  # fmt: skip
        tok = AutoTokenizer.from_pretrained(path)
        assert tok.convert_tokens_to_ids("<|image_pad|>") == config["image_token_id"] == 998
        batch = torch.load(Path(path) / "batch.pt")
        assert batch["image_grid_thw"].tolist() == [[1, 4, 8], [1, 2, 2]]
        assert (batch["input_ids"] == 998).sum(1).tolist() == [8, 1, 0]
        processor = json.loads((Path(path) / "preprocessor_config.json").read_text())
        assert processor["image_processor_type"] == "Qwen2VLImageProcessor"


def test_mrope_positions_are_transformers_get_rope_index(vl_spec):
    """On every row's tokens (transformers leaves the padding at 0)."""
    for path in vl_spec["models"].values():
        batch = torch.load(Path(path) / "batch.pt")
        got = mrope_position_ids(batch["input_ids"], batch["lengths"], batch["image_grid_thw"],
                                 image_token_id=998, spatial_merge_size=2)  # fmt: skip
        mask = batch["attention_mask"].bool()
        assert torch.equal(got[:, mask], batch["hf_position_ids"][:, mask])
        image = got[:, 0, batch["input_ids"][0] == 998]  # the 2×4 merged grid of image 1
        assert (image - image.min()).tolist() == [[0] * 8, [0] * 4 + [1] * 4, [0, 1, 2, 3] * 2]


def test_mrope_positions_refuse_tokens_and_grids_that_disagree():
    ids = torch.tensor([[5, 9, 9, 9, 6]])
    with pytest.raises(ValueError, match="needs 4 image tokens"):
        mrope_position_ids(ids, torch.tensor([5]), torch.tensor([[1, 4, 4]]),
                           image_token_id=9, spatial_merge_size=2)  # fmt: skip
    with pytest.raises(ValueError, match="2 image grids but image tokens for 1"):
        mrope_position_ids(ids, torch.tensor([5]), torch.tensor([[1, 2, 6], [1, 2, 2]]),
                           image_token_id=9, spatial_merge_size=2)  # fmt: skip


def test_image_embeddings_fill_the_image_tokens_row_by_row():
    """Sequence-first embeddings ``[s, b, h]``, filled in the tokens' order of ``[b, s]``
    (not the order of ``[s, b]``, which would swap the two rows' images)."""
    ids = torch.tensor([[9, 1, 9], [2, 9, 3]])
    emb = torch.zeros(3, 2, 1)
    images = torch.tensor([[10.0], [11.0], [12.0]])
    out = place_image_embeddings(emb, ids, images, image_token_id=9)
    assert out[:, :, 0].T.tolist() == [[10.0, 0.0, 11.0], [0.0, 12.0, 0.0]]
    with pytest.raises(ValueError, match="3 image tokens but 2 image embeddings"):
        place_image_embeddings(emb, ids, images[:2], image_token_id=9)


@pytest.mark.multirank
def test_logits_equal_transformers_at_tp1_tp2_pp2(launched):
    """fp32, every row's tokens, the whole vocabulary: within 1e-4 (measured ≤ 1e-5)."""
    for key in ("tp1_pp1", "tp2_pp1", "tp1_pp2"):
        for family in FAMILIES:
            r = launched[f"{key}/{family}"]
            assert r["logit_diff"] <= 1e-4, (key, family, r["logit_diff"])


@pytest.mark.multirank
def test_the_comparison_fails_with_wrong_mrope_sections_or_unplaced_images(launched):
    """The same forward with the temporal/height/width sections permuted, or with the
    placeholders' word embeddings where the images belong, is far from transformers."""
    for family in FAMILIES:
        r = launched[f"tp1_pp1/{family}"]
        assert r["mrope_permuted"] > 1e-2 and r["images_not_placed"] > 1e-2, (family, r)


@pytest.mark.multirank
def test_only_the_first_stage_holds_the_vision_tower(launched):
    for family in FAMILIES:
        assert launched[f"tp2_pp1/{family}"]["vision_on_ranks"] == [True, True]
        assert launched[f"tp1_pp2/{family}"]["vision_on_ranks"] == [True, False]


@pytest.mark.multirank
def test_layouts_not_built_yet_are_refused_in_one_line(launched):
    refused = launched["refused"]
    assert "sequence parallelism is not built yet" in refused["sp"]
    assert "CP=2 is not built yet" in refused["cp"]
