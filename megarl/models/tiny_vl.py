"""Tiny, fully random Qwen2.5-VL and Qwen2-VL checkpoints for CPU tests (issue 58).

transformers builds the model from a tiny config; every parameter is then redrawn from one
seeded generator under :mod:`megarl.models.tiny`'s rules (biases and norm weights too), and the
checkpoint is written by ``save_pretrained``, so the tensor names are transformers' own. The
tokenizer is :func:`megarl.models.tiny.build_tokenizer`'s byte-level BPE with Qwen's four vision
special tokens as its last ids, and a chat template that renders ``{"type": "image"}`` content
items as ``<|vision_start|><|image_pad|><|vision_end|>``, as Qwen's does. Beside it goes the
image processor's ``preprocessor_config.json`` (``Qwen2VLImageProcessor``, patch 14, merge 2,
at most :data:`TINY_MAX_PIXELS` pixels an image). transformers 5 builds the whole
``Qwen2_5_VLProcessor`` only with torchvision installed (its video processor), which this
machine's environment removes; the image processor and the tokenizer load without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megarl.models.tiny import EMBED_STD, SPECIAL_TOKENS, WEIGHT_STD, build_tokenizer
from megarl.models.tiny_families import VL_ARCHITECTURES

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen's vision special tokens; a tiny VL vocabulary of V tokens gives them ids V-4 .. V-1."""

VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen2-VL's chat template, cut to what the tiny tasks use: text and image (or video)
content items, each image one placeholder that the processor widens to its token count."""

TINY_VISION = {
    "depth": 2,
    "hidden_size": 64,
    "num_heads": 2,
    "intermediate_size": 128,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1],
}
"""The tiny vision tower (Qwen2.5-VL names): 2 blocks of width 64 (head_dim 32), 14-pixel
patches merged 2×2 into one language token; block 0 attends within windows of 56 pixels (2×2
merged tokens), block 1 over the whole image, so an image wider than 56 pixels crosses both."""

TINY_MIN_PIXELS = 28 * 28
"""Smallest image area after the processor's resize: one 28×28 image is one language token."""
TINY_MAX_PIXELS = 28 * 28 * 16
"""Largest image area after the processor's resize: at most 16 language tokens an image."""


def tiny_vl_hf_config(
    family: str = "qwen2_5_vl",
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 1000,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    mrope_section: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` contents of a tiny VL model: a Qwen2 language model of the given shape
    and the :data:`TINY_VISION` tower (Qwen2-VL's named as its config names them).

    ``mrope_section``: the rotary frequencies given to the temporal, height and width positions
    (they sum to head_dim / 2); default Qwen's proportions, 1/4, 3/8 and 3/8 ([16, 24, 24] of
    64). transformers' Qwen2-VL attention takes head_dim = hidden_size / heads.
    """
    if family not in VL_ARCHITECTURES:
        raise ValueError(f"unknown VL family {family!r}; choose from {sorted(VL_ARCHITECTURES)}")
    half = hidden_size // num_attention_heads // 2
    if mrope_section is None:
        mrope_section = (half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8)
    if sum(mrope_section) != half:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim / 2 = {half}")
    ids = {tok: vocab_size - len(VISION_TOKENS) + i for i, tok in enumerate(VISION_TOKENS)}
    text = {
        "model_type": f"{family}_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": WEIGHT_STD,
        "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": rope_theta,
            "mrope_section": list(mrope_section),
        },
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "eos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "pad_token_id": SPECIAL_TOKENS.index("<|pad|>"),
    }
    vision: dict[str, Any] = dict(TINY_VISION)
    if family == "qwen2_5_vl":
        vision.update(model_type="qwen2_5_vl_vision", out_hidden_size=hidden_size,
                      hidden_act="silu", tokens_per_second=2)  # fmt: skip
    else:  # Qwen2-VL: embed_dim is the tower's width, hidden_size the language model's
        vision = {k: v for k, v in vision.items()
                  if k not in ("intermediate_size", "window_size", "fullatt_block_indexes")}  # fmt: skip
        vision.update(model_type="qwen2_vl_vision", embed_dim=vision.pop("hidden_size"),
                      hidden_size=hidden_size, mlp_ratio=2, hidden_act="quick_gelu")  # fmt: skip
    return {
        "architectures": [VL_ARCHITECTURES[family]],
        "model_type": family,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": tie_word_embeddings,
    }


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from one seeded generator, in ``named_parameters`` order: norm weights
    1 + 0.1·N(0, 1), biases 0.1·N(0, 1), the embedding and output layer N(0, EMBED_STD), every
    other matrix N(0, WEIGHT_STD / √(fan_in / 64)) (the vision tower's 1176-wide patch
    projection too: its activations stay of order one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1 and ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith(".bias"):
                value = 0.1 * noise
            elif "embed_tokens" in name or name == "lm_head.weight":
                value = EMBED_STD * noise
            else:
                fan_in = p[0].numel()
                value = WEIGHT_STD * min(1.0, (64 / fan_in) ** 0.5) * noise
            p.copy_(value.to(p.dtype))


def build_vl_tokenizer(vocab_size: int = 1000, *, seed: int = 0) -> Any:
    """:func:`~megarl.models.tiny.build_tokenizer` of ``vocab_size - 4`` tokens plus
    :data:`VISION_TOKENS` (special, ids ``vocab_size - 4`` ..) and :data:`VL_CHAT_TEMPLATE`."""
    tok = build_tokenizer(vocab_size - len(VISION_TOKENS), seed=seed)
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tok.chat_template = VL_CHAT_TEMPLATE
    if len(tok) != vocab_size:
        raise RuntimeError(f"VL tokenizer has {len(tok)} tokens, wanted {vocab_size}")
    return tok


def make_tiny_vl_model(
    out_dir: str | Path,
    family: str = "qwen2_5_vl",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **shape: Any,
) -> Path:
    """Write a random tiny Qwen2.5-VL / Qwen2-VL checkpoint: config, safetensors (transformers'
    names), generation config, tokenizer with chat template, image processor config.

    ``shape``: :func:`tiny_vl_hf_config`'s arguments. The same arguments give the same tensors.
    """
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_vl_hf_config(family, **shape)
    arch = cfg["architectures"][0]
    config_class = getattr(transformers, arch.replace("ForConditionalGeneration", "Config"))
    config = config_class(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    )
    config.architectures = [arch]
    torch.manual_seed(seed)  # transformers' own init, all redrawn below
    model = getattr(transformers, arch)(config).to(dtype)
    _redraw(model, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.text_config.bos_token_id,
        eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id,
    )  # no sampling defaults: vLLM would adopt them (generation_config="auto")
    model.save_pretrained(str(out))
    tok = build_vl_tokenizer(cfg["text_config"]["vocab_size"], seed=seed)
    tok.save_pretrained(str(out))
    vision = cfg["vision_config"]
    processor = Qwen2VLImageProcessorPil(
        min_pixels=TINY_MIN_PIXELS,
        max_pixels=TINY_MAX_PIXELS,
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
    )
    processor.save_pretrained(str(out))
    # The processor class that loads the whole directory (AutoProcessor), as Qwen's hub files say.
    name = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen2_vl": "Qwen2VLProcessor"}[family]
    pre = json.loads((out / "preprocessor_config.json").read_text())
    pre["processor_class"] = name
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2, sort_keys=True) + "\n")
    return out
