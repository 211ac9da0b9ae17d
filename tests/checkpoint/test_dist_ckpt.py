"""megarl.checkpoint: the meta file beside the shards, refusing what is not a checkpoint, and a
checkpoint of another model refused naming keys.

The Megatron parts run in one spawned rank (one process start for all of them); the round trip
across layouts is in tests/models (test_convert.py, test_parallel_models.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.checkpoint.meta import META_FILE, read_checkpoint_meta
from megarl.parallel.spawn import run_local_world


def checkpoint_checks(root: str) -> dict:
    """Save a tiny model with meta, reload it, and try the refusals; report what happened."""
    import torch

    from megarl.checkpoint.dist_ckpt import (
        CheckpointError,
        CheckpointMismatchError,
        load_model_checkpoint,
        save_model_checkpoint,
    )
    from megarl.config.model_dims import ModelDims
    from megarl.models.build import build_model
    from megarl.models.tiny import tiny_hf_config
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.parallel.layout import ParallelLayout

    init_distributed(ParallelLayout(1, 1), seed=3)
    dims = ModelDims.from_hf_config(tiny_hf_config("qwen2", num_layers=2))
    saved = build_model(dims, ParallelLayout(1, 1)).chunks
    ckpt = Path(root) / "ckpt"
    save_model_checkpoint(saved, ckpt, meta={"step": 7, "note": "tiny"})
    out: dict = {"files": sorted(p.name for p in ckpt.iterdir())}

    loaded = build_model(dims, ParallelLayout(1, 1), initialize=False).chunks
    load_model_checkpoint(loaded, ckpt)
    out["equal"] = all(
        torch.equal(a, b)
        for a, b in zip(saved[0].state_dict().values(), loaded[0].state_dict().values())
        if isinstance(a, torch.Tensor)
    )

    def refusal(path: Path, chunks) -> list[str]:
        try:
            load_model_checkpoint(chunks, path)
        except CheckpointError as exc:
            return [type(exc).__name__, str(exc)]
        return []

    (Path(root) / "not-a-ckpt").mkdir()
    out["not_a_checkpoint"] = refusal(Path(root) / "not-a-ckpt", loaded)
    deeper = build_model(
        ModelDims.from_hf_config(tiny_hf_config("qwen2", num_layers=3)),
        ParallelLayout(1, 1),
        initialize=False,
    ).chunks
    out["other_model"] = refusal(ckpt, deeper)
    out["mismatch_is_checkpoint_error"] = issubclass(CheckpointMismatchError, CheckpointError)
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("ckpt")
    return root, run_local_world(checkpoint_checks, 1, (str(root),))[0]


def test_meta_is_written_beside_the_shards_and_read_back(checks):
    root, out = checks
    assert META_FILE in out["files"] and "metadata.json" in out["files"]
    assert read_checkpoint_meta(root / "ckpt") == {"step": 7, "note": "tiny"}
    assert json.loads((root / "ckpt" / META_FILE).read_text())["step"] == 7
    assert out["equal"]


def test_a_directory_without_meta_reads_as_empty_meta(tmp_path: Path):
    assert read_checkpoint_meta(tmp_path) == {}


def test_a_directory_that_is_not_a_checkpoint_is_refused_naming_it(checks):
    root, out = checks
    kind, message = out["not_a_checkpoint"]
    assert kind == "CheckpointError"
    assert str(root / "not-a-ckpt") in message and "metadata.json" in message


def test_a_checkpoint_of_another_model_is_refused_naming_keys(checks):
    root, out = checks
    kind, message = out["other_model"]
    assert out["mismatch_is_checkpoint_error"]
    assert kind == "CheckpointError" and str(root / "ckpt") in message
    # the stacked layer tensors: 2 layers saved, 3 expected
    assert "shape mismatch" in message and "decoder.layers." in message
