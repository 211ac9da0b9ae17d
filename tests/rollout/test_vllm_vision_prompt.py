"""megarl's widened image prompts as vLLM takes them (:mod:`megarl.rollout.vllm_vision`), in
process; the real engine's checks are test_vllm_vision_language.py's."""

from __future__ import annotations

import pytest


def test_vllm_image_prompt_narrows_each_run_to_one_placeholder():
    """megarl's widened ids -> vLLM's prompt: one placeholder a run, the images beside it; a
    text prompt as it is; runs and images that differ in number refused."""
    from PIL import Image

    from megarl.rollout.vllm_vision import vllm_image_prompt

    pad, a, b = 9, Image.new("RGB", (28, 28)), Image.new("RGB", (56, 28))
    got = vllm_image_prompt([1, 8, pad, pad, pad, 7, 2, 8, pad, 7], [a, b], pad, index=0)
    assert got == {"prompt_token_ids": [1, 8, pad, 7, 2, 8, pad, 7],
                   "multi_modal_data": {"image": [a, b]}}  # fmt: skip
    assert vllm_image_prompt([1, 2], None, pad, index=0) == {"prompt_token_ids": [1, 2]}
    with pytest.raises(ValueError, match="prompt 3: 2 runs of image tokens .id 9. for 1 images"):
        vllm_image_prompt([pad, 1, pad], [a], pad, index=3)
    with pytest.raises(ValueError, match="prompt 0: 0 runs of image tokens .id 9. for 1 images"):
        vllm_image_prompt([1, 2], [a], pad, index=0)
