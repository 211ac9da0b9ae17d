"""vLLM on image prompts (issue 58): a real vLLM engine and the real Megatron VL actor on CPU,
fp32, for the tiny Qwen2.5-VL and Qwen2-VL.

One 2-rank launch (``_vllm_vision_language_worker.py``) runs every case: vLLM TP 1 (rollout DP
2) and TP 2, each fed by the actor at the same TP, and vLLM TP 2 fed by the actor at PP 2. The prompts come from a geo3k-layout parquet
through ``PromptDataset``: two with one image, one with two, one text only. vLLM starts without
weights; the actor's sync (vision tower and language model) gives them. After the first sync,
after a sync of the perturbed language model alone (a control), and after a full sync of the
perturbed actor, vLLM's log-probs of the sampled tokens are compared with the actor's.
"""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_torchrun

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.multirank,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed"),
]

WORKER = Path(__file__).with_name("_vllm_vision_language_worker.py")
FAMILIES = {"qwen2_5_vl": 500, "qwen2_vl": 501}
"""Tiny random VL models and their seeds."""
CASES = {
    "qwen2_5_vl/tp1": ("qwen2_5_vl", 1, 1, 1),
    "qwen2_vl/tp1": ("qwen2_vl", 1, 1, 1),
    "qwen2_5_vl/tp2": ("qwen2_5_vl", 2, 1, 2),
    "qwen2_vl/tp2": ("qwen2_vl", 2, 1, 2),
    "qwen2_5_vl/pp2": ("qwen2_5_vl", 1, 2, 2),
}
"""Case -> (family, the actor's TP and PP, vLLM's TP). At PP 2 the second stage has no vision
tower: it receives the first stage's."""
LOGPROB_TOL = 1e-4
STALE_VISION = 1e-2
"""The least log-prob difference on image prompts when the vision tower was not synced."""


def _png(height: int, width: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _parquet(path: Path) -> str:
    """verl's geo3k layout: images as HF datasets' ``{"bytes": ...}`` structs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def row(i: int, images: list | None, problem: str) -> dict:
        return {"data_source": "hiyouga/geometry3k", "images": images,
                "prompt": [{"role": "user", "content": problem}],
                "reward_model": {"style": "rule", "ground_truth": str(i)}}  # fmt: skip

    rows = [
        row(0, [{"bytes": _png(56, 112, 0)}], "<image>Find x."),  # 8 tokens, two windows
        row(1, [{"bytes": _png(30, 30, 1)}, {"bytes": _png(60, 40, 2)}], "<image>and<image>?"),
        row(2, None, "What is 2 + 3?"),
        row(3, [{"bytes": _png(84, 56, 3)}], "How many <image> sides?"),
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    from megarl.models.tiny_vl import make_tiny_vl_model

    tmp = tmp_path_factory.mktemp("vllm_vl")
    models = {f: str(make_tiny_vl_model(tmp / f, f, seed=s)) for f, s in FAMILIES.items()}
    cases = [[key, *case] for key, case in CASES.items()]
    spec = {"models": models, "parquet": _parquet(tmp / "train.parquet"), "cases": cases}
    (tmp / "spec.json").write_text(json.dumps(spec))
    run_torchrun(WORKER, 2, [str(tmp / "spec.json")], timeout=600)
    return json.loads((tmp / "results.json").read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_logprobs_equal_the_actors_after_each_sync(results, case):
    """vLLM's log-probs of the sampled tokens = the actor's within 1e-4, on image and text
    prompts: after the first sync into an engine that read no weights, and after the perturbed
    actor's sync (every weight changed, the vision tower's too)."""
    r = results[case]
    assert r["images"] == [1, 2, 0, 1]
    for stage in ("first", "perturbed"):
        assert r[stage]["tokens"] > 0
        assert r[stage]["image"] <= LOGPROB_TOL, (stage, r[stage])
        assert r[stage]["text"] <= LOGPROB_TOL, (stage, r[stage])


@pytest.mark.parametrize("case", list(CASES))
def test_a_sync_without_the_vision_tower_is_caught(results, case):
    """The control: the perturbed language model synced without the vision tower agrees with
    the actor on the text prompt only; the image prompts are far off (so the comparison does
    see the vision tower's weights)."""
    control = results[case]["language_only"]
    assert control["text"] <= LOGPROB_TOL, control
    assert control["image"] >= STALE_VISION, control


def test_the_sync_counts_the_vision_tower(results):
    """The sync hands vLLM the language model's buckets and the whole vision tower."""
    for case in CASES:
        r = results[case]
        assert r["sync_bytes"] > r["language_bytes"]


def test_a_prompt_widened_otherwise_than_vllm_is_refused(results):
    """vLLM widens each image itself; a prompt whose image tokens do not match (here one short)
    is refused, not scored at shifted positions."""
    got = results["qwen2_5_vl/tp1"]["short_prompt"]
    assert "prompt 0: vLLM widened the images to 23 prompt tokens, megarl's prompt has 22" in got
