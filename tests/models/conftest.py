"""The multi-rank model launches and the conversions, shared by every test module that reads
their results.

One torchrun launch per world size runs every model check (``_parallel_worker.py``); the
fixtures are session-scoped so that ``test_parallel_models.py`` and ``test_layout_rule.py``
read the same launch instead of paying Megatron's start-up twice. Likewise one TP=2 conversion
serves ``test_convert.py`` and ``test_convert_failures.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun
from tests.models._convert_cli import ok, run_convert

WORKER = Path(__file__).with_name("_parallel_worker.py")
MODELS = {
    "qwen2": {"family": "qwen2"},
    "llama_tied": {"family": "llama", "tie_word_embeddings": True},
    "llama_untied": {"family": "llama"},
}
REWARD_MODELS = {"rm_llama": "llama", "rm_qwen2": "qwen2"}
"""Tiny random ``*ForSequenceClassification`` reward models (random score heads)."""


@pytest.fixture(scope="session")
def spec(tmp_path_factory) -> dict:
    """Tiny randomised checkpoints, HF reference logits and a variable-length batch."""
    from transformers import AutoModelForCausalLM

    from megarl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("parallel")
    g = torch.Generator().manual_seed(11)
    n, s = 4, 14
    ids = torch.randint(0, 1000, (n, s), generator=g)
    batch = {
        "input_ids": ids,
        "prompt_lengths": torch.tensor([3, 6, 2, 5]),
        "lengths": torch.tensor([14, 9, 7, 12]),
        "value_loss_weights": torch.randn(n, 11, generator=g),
    }
    torch.save(batch, tmp / "batch.pt")
    paths = {}
    for i, (name, kw) in enumerate(MODELS.items()):
        path = make_tiny_model(tmp / name, seed=100 + i, **kw)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            torch.save(hf(ids).logits, Path(path) / "ref_logits.pt")
        paths[name] = str(path)
    spec = {"models": paths, "batch": str(tmp / "batch.pt"), "tmp": str(tmp)}
    spec.update(_packing_batch(tmp, g, paths["qwen2"]))
    spec.update(_reward_models(tmp, g))
    spec.update(_moe_models(tmp, g))
    (tmp / "spec.json").write_text(json.dumps(spec))
    return spec


PACKING_BATCH = {"prompt_lengths": [12, 3, 4, 2, 1, 6], "lengths": [13, 7, 11, 5, 2, 13]}
"""Responses of 1, 4, 7, 3, 1 and 7 tokens: one-token responses, lengths that are multiples of
nothing in particular (packed rows pad each to 2·CP)."""


def _packing_batch(tmp: Path, g: torch.Generator, qwen2: str) -> dict:
    """A batch for the packed-row checks and HF's (unpadded, one sequence at a time) logits of
    the tiny Qwen2 on it."""
    from transformers import AutoModelForCausalLM

    lengths = torch.tensor(PACKING_BATCH["lengths"])
    ids = torch.randint(0, 1000, (len(lengths), int(lengths.max())), generator=g)
    hf = AutoModelForCausalLM.from_pretrained(qwen2, dtype=torch.float32)
    with torch.no_grad():
        logits = torch.zeros(*ids.shape, hf.config.vocab_size)
        for i, n in enumerate(lengths.tolist()):
            logits[i, :n] = hf(ids[i : i + 1, :n]).logits[0]
    batch = {"input_ids": ids, "prompt_lengths": torch.tensor(PACKING_BATCH["prompt_lengths"]),
             "lengths": lengths, "hf_logits": logits}  # fmt: skip
    torch.save(batch, tmp / "packing_batch.pt")
    return {"packing_batch": str(tmp / "packing_batch.pt")}


def _reward_models(tmp: Path, g: torch.Generator) -> dict:
    """Reward models, a right-padded batch (pad_token_id after each length, never inside) and
    HF's scores of it (``*ForSequenceClassification``: the last non-pad token's score)."""
    from transformers import AutoModelForSequenceClassification

    from megarl.models.tiny import SPECIAL_TOKENS, make_tiny_reward_model

    pad = SPECIAL_TOKENS.index("<|pad|>")
    lengths = torch.tensor([14, 9, 7, 12])
    ids = torch.randint(len(SPECIAL_TOKENS), 1000, (4, 14), generator=g)
    mask = torch.arange(14)[None] < lengths[:, None]
    ids[~mask] = pad
    torch.save({"input_ids": ids, "lengths": lengths}, tmp / "rm_batch.pt")
    paths = {}
    for i, (name, family) in enumerate(REWARD_MODELS.items()):
        path = make_tiny_reward_model(tmp / name, family, seed=200 + i)
        hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        assert hf.config.pad_token_id == pad
        with torch.no_grad():
            torch.save(hf(ids, attention_mask=mask.long()).logits[:, 0], path / "ref_scores.pt")
        paths[name] = str(path)
    return {"reward_models": paths, "rm_batch": str(tmp / "rm_batch.pt")}


MOE_MODELS = {
    "qwen3_moe": {"family": "qwen3_moe"},  # norm_topk_prob: renormalised top-k (as 30B-A3B)
    # the full softmax's top-k (HF's default for Qwen2-MoE), a gated shared expert, qkv biases
    "qwen2_moe": {"family": "qwen2_moe", "norm_topk_prob": False, "num_layers": 2},
    "mixtral": {"family": "mixtral"},
}
"""Tiny random MoE models: 8 experts, top-2, hidden 128, head_dim 32."""


def _moe_models(tmp: Path, g: torch.Generator) -> dict:
    """MoE models and HF's logits of a batch of different lengths (right-padded)."""
    from transformers import AutoModelForCausalLM

    from megarl.models.tiny import make_tiny_model

    ids = torch.randint(0, 1000, (4, 14), generator=g)
    torch.save({"input_ids": ids, "lengths": torch.tensor([14, 9, 7, 12])}, tmp / "moe_batch.pt")
    paths = {}
    for i, (name, kw) in enumerate(MOE_MODELS.items()):
        path = make_tiny_model(tmp / name, seed=300 + i, **kw)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            torch.save(hf(ids).logits, path / "ref_logits.pt")
        paths[name] = str(path)
    return {"moe_models": paths, "moe_batch": str(tmp / "moe_batch.pt")}


def _results(spec: dict, world: int) -> dict:
    out = Path(spec["tmp"]) / f"results_ws{world}.pt"
    if not out.exists():
        run_torchrun(WORKER, world, [str(Path(spec["tmp"]) / "spec.json")])
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="session")
def ws1(spec):
    return _results(spec, 1)


@pytest.fixture(scope="session")
def ws2(spec, qwen2, qwen2_tp2, moe_ep2):
    """The world-2 launch; it also loads ``megarl convert``'s TP=2 checkpoint (and a Qwen3-MoE
    one at EP 2) as initial weights (``use_dist_checkpointing``, test_dist_ckpt_init.py)."""
    spec["dist_ckpt"] = {"hf": str(qwen2), "ckpt": str(qwen2_tp2[0])}
    spec["moe_dist_ckpt"] = str(moe_ep2)
    (Path(spec["tmp"]) / "spec.json").write_text(json.dumps(spec))
    return _results(spec, 2)


@pytest.fixture(scope="session")
def moe_ep2(spec) -> Path:
    """``megarl convert hf-to-megatron --ep 2`` of the tiny Qwen3-MoE."""
    from tests.models._convert_cli import ok, run_convert

    ckpt = Path(spec["tmp"]) / "qwen3_moe-ep2"
    hf = spec["moe_models"]["qwen3_moe"]
    ok(run_convert("hf-to-megatron", "--hf-path", hf, "--out", str(ckpt), "--ep", "2"))
    return ckpt


@pytest.fixture(scope="session")
def ws4(spec):
    return _results(spec, 4)


# -- conversions -------------------------------------------------------------------------------

STALE_FILES = ("__9_9.distcp", ".metadata", "metadata.json", "stale.txt")
"""What an older checkpoint left in ``--out`` before the ``--force`` conversion of
:func:`qwen2_tp2`."""


@pytest.fixture(scope="session")
def convert_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="session")
def qwen2(convert_root: Path) -> Path:
    """Tiny Qwen2 with vocab 1100: padded to 1280 rows at TP=2 but 1152 at TP=1 (layouts
    disagree on the padding)."""
    from megarl.models.tiny import make_tiny_model

    return make_tiny_model(convert_root / "qwen2", "qwen2", vocab_size=1100, seed=1)


@pytest.fixture(scope="session")
def qwen2_tp2(convert_root: Path, qwen2: Path):
    """(checkpoint, process) of ``hf-to-megatron --tp 2 --verify --force`` into a directory
    holding an older checkpoint's files (:data:`STALE_FILES`)."""
    ckpt = convert_root / "qwen2-tp2"
    ckpt.mkdir()
    for stale in STALE_FILES:
        (ckpt / stale).write_text("old")
    result = run_convert(
        "hf-to-megatron", "--hf-path", str(qwen2), "--out", str(ckpt), "--tp", "2", "--verify",
        "--force",
    )  # fmt: skip
    return ckpt, ok(result)
