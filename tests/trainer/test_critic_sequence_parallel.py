"""The critic under sequence parallelism: values and gradients equal those without it (and the
actor's log-probs and last-position logits).

With ``sequence_parallel: true`` the hidden states reaching the value head are sharded along the
sequence; the head gathers them, and its weight gradient must not be reduced twice (or missed)
over TP. Each case runs the trainer's value pass and one ``update_critic`` with SGD at lr 1
(the weight change is the reduced gradient) on a fixed batch whose longest sequence has an odd
length (sequence parallelism splits the sequence over TP, so the runner must pad it).

- GPU (marked ``gpu``, skipped without CUDA): Transformer Engine's layer spec (the local one as
  on CPU when TE is not installed) at TP=2, SP on vs off, fp32. One GPU is enough: both ranks
  then share it over gloo (see the worker).
- CPU: the same harness at TP=1 (DP=2), TP=2, and TP=2 with SP on the local spec, whose torch
  norms megarl marks for the TP gradient all-reduce as TE's norms are (Megatron's wrapper
  refuses SP only for lack of that mark: ``megarl.models.gpt.TorchNorm``); float64, so any difference is a wrong collective, not
  rounding. Also a Mixture-of-Experts critic (Qwen3-MoE) at EP 1 and EP 2.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun

WORKER = Path(__file__).with_name("_critic_sp_worker.py")
pytestmark = pytest.mark.multirank

PROMPTS = [[5, 9, 14], [7, 3, 3, 8, 2], [11, 4, 6, 10], [2, 12]]
RESPONSES = [[21, 22, 23, 24], [31, 32], [41, 42, 43, 44, 45, 46, 47], [51, 52, 53]]
"""Longest prompt + response: 11 tokens (odd)."""


def _run(tmp: Path, cases: list[dict], **spec) -> dict:
    from megarl.models.tiny import make_tiny_model

    torch.manual_seed(0)
    width = max(len(r) for r in RESPONSES)
    batch = {
        "prompts": PROMPTS,
        "responses": RESPONSES,
        "prompt_ids": [0, 1, 2, 3],
        "values": torch.randn(len(RESPONSES), width).double(),
        "returns": torch.randn(len(RESPONSES), width).double(),
    }
    torch.save(batch, tmp / "batch.pt")
    spec = {
        "model": str(make_tiny_model(tmp / "model", family="qwen2", seed=5)),
        "moe_model": str(make_tiny_model(tmp / "moe", family="qwen3_moe", seed=6)),
        "batch": str(tmp / "batch.pt"),
        "out": str(tmp / "results.pt"),
        "micro_batch_size": 2,
        "cases": cases,
        **spec,
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    run_torchrun(WORKER, 2, [str(tmp / "spec.json")], timeout=900)
    return torch.load(tmp / "results.pt", weights_only=False)


def _assert_same_critic(ref: dict, other: dict, *, rtol: float) -> None:
    """Values and every parameter's gradient (before − after at lr 1), relative to their scale."""
    for key in ("values", "log_probs", "last_logits"):
        if key not in other:  # (context parallelism: no rollout-engine pass)
            continue
        scale = float(ref[key].abs().max())
        assert float((other[key] - ref[key]).abs().max()) <= rtol * scale, key
    assert set(other["after"]) == set(ref["after"])
    experts = [n for n in ref["after"] if ".experts." in n]
    assert not experts or any(bool((ref["before"][n] != ref["after"][n]).any()) for n in experts)
    for name in ref["after"]:
        g_ref = ref["before"][name] - ref["after"][name]
        g = other["before"][name] - other["after"][name]
        assert torch.equal(other["before"][name], ref["before"][name]), name
        if ".experts." not in name:  # (an expert no token reached has none)
            assert float(g_ref.abs().max()) > 0, name  # every parameter gets a gradient
        assert float((g - g_ref).abs().max()) <= rtol * float(g_ref.abs().max()), name
    keys = [k for k in ref["metrics"] if k.startswith(("critic/vf_", "critic/expert_load"))]
    assert {"critic/vf_loss", "critic/vf_clipfrac"} <= set(keys)
    for key in keys:
        assert other["metrics"][key] == pytest.approx(ref["metrics"][key], rel=rtol, abs=rtol)


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (gloo reduces no CUDA tensors)"
)
def test_critic_sequence_parallel_equals_no_sp_on_gpu(tmp_path):
    te = importlib.util.find_spec("transformer_engine") is not None
    cases = [{"name": "tp2", "tp": 2, "sequence_parallel": False},
             {"name": "tp2_sp", "tp": 2, "sequence_parallel": True},
             {"name": "tp2_sp_packed", "tp": 2, "sequence_parallel": True, "pack": True},
             {"name": "cp2_packed", "tp": 1, "cp": 2, "sequence_parallel": False, "pack": True}]  # fmt: skip
    # Without Transformer Engine the local spec runs SP on GPU the way the CPU test runs it.
    out = _run(tmp_path, cases, dtype="float32",
               transformer_impl="transformer_engine" if te else "local")  # fmt: skip
    assert out["tp2_sp"]["sequence_parallel"] and not out["tp2"]["sequence_parallel"]
    # fp32: SP changes where partial sums meet (norm weight gradients), not what is summed.
    _assert_same_critic(out["tp2"], out["tp2_sp"], rtol=1e-4)
    # Packed rows (TE's THD attention) and context parallelism (TE's CP attention, cp_comm_type
    # p2p by default): the same values, log-probs and gradients.
    _assert_same_critic(out["tp2"], out["tp2_sp_packed"], rtol=1e-4)
    _assert_same_critic(out["tp2"], out["cp2_packed"], rtol=1e-4)


def test_critic_layouts_and_sequence_parallel_agree_on_cpu(tmp_path):
    moe = {"tp": 1, "sequence_parallel": False, "model": "moe_model"}
    packed = {"pack": True, "sequence_parallel": False}
    cases = [{"name": "tp1", "tp": 1, "sequence_parallel": False},
             {"name": "tp2", "tp": 2, "sequence_parallel": False},
             {"name": "tp2_sp", "tp": 2, "sequence_parallel": True},
             {"name": "tp2_sp_packed", "tp": 2, "sequence_parallel": True, "pack": True},
             {"name": "cp2_packed", "tp": 1, "cp": 2, **packed},
             {"name": "moe_ep1", "ep": 1, **moe}, {"name": "moe_ep2", "ep": 2, **moe},
             {"name": "moe_ep2_packed", "ep": 2, **moe, "pack": True},
             {"name": "moe_cp2_packed", "ep": 1, "cp": 2, **moe, "pack": True}]  # fmt: skip
    out = _run(tmp_path, cases, dtype="float64", transformer_impl="local")
    assert out["tp2_sp"]["sequence_parallel"] and out["tp2_sp_packed"]["sequence_parallel"]
    _assert_same_critic(out["tp1"], out["tp2"], rtol=1e-6)
    _assert_same_critic(out["tp1"], out["tp2_sp"], rtol=1e-6)
    # Packed rows (THD): each sequence padded to a multiple of TP under SP, of 2·CP under CP.
    _assert_same_critic(out["tp1"], out["tp2_sp_packed"], rtol=1e-6)
    _assert_same_critic(out["tp1"], out["cp2_packed"], rtol=1e-6)
    # A Mixture-of-Experts critic (Qwen3-MoE) with its experts over EP 2: the same values,
    # gradients (experts' included) and metrics (the expert load too) as at EP 1.
    assert "critic/expert_load_imbalance" in out["moe_ep1"]["metrics"]
    _assert_same_critic(out["moe_ep1"], out["moe_ep2"], rtol=1e-6)
    _assert_same_critic(out["moe_ep1"], out["moe_ep2_packed"], rtol=1e-6)
    _assert_same_critic(out["moe_ep1"], out["moe_cp2_packed"], rtol=1e-6)
