"""Disaggregated placement at staleness 0 (issue 26, item 4's first half): two GRPO steps with
vLLM on a rank of its own equal the colocated run of the same config and seeds, through the
trainer's own calls (tests/trainer/_disagg_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_disagg_worker.py")
pytestmark = [pytest.mark.vllm, pytest.mark.multirank]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_overrides) -> dict:
    tmp = tmp_path_factory.mktemp("disagg")
    spec = {
        "config": str(REPO / "configs" / "grpo_tiny_cpu.yaml"),
        "overrides": [
            *tiny_overrides,
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "trainer.val_before_train=false",
        ],
        "tmp": str(tmp),
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    run_torchrun(WORKER, 2, [str(tmp / "spec.json"), "colocated"], timeout=900)
    run_torchrun(WORKER, 3, [str(tmp / "spec.json"), "split"], timeout=900)
    return {m: torch.load(tmp / f"{m}.pt", weights_only=False) for m in ("colocated", "split")}


def test_the_trainer_sees_its_own_world(runs):
    assert runs["colocated"]["world"] == runs["split"]["world"] == 2


def test_vllm_on_its_own_rank_gives_the_colocated_run(runs):
    """The same responses and rewards at every step, the metrics and the actor's weights after
    two updates within float noise (vLLM batches the requests differently)."""
    colocated, split = runs["colocated"], runs["split"]
    for step, (a, b) in enumerate(zip(colocated["steps"], split["steps"], strict=True), start=1):
        assert a["input_ids"] == b["input_ids"], step
        assert a["rewards"] == b["rewards"], step
        for key, value in a["metrics"].items():
            if key.startswith(("timing", "perf", "memory")):
                continue
            assert b["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)
        assert b["metrics"]["rollout/logprob_diff_max"] <= 1e-4
    for name, w in colocated["weights"].items():
        assert torch.allclose(split["weights"][name], w, rtol=1e-4, atol=1e-6), name
