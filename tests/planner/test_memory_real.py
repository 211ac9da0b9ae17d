"""The memory planner against real Megatron objects on CPU (one torchrun launch per world size).

Model state: after one optimizer step, the bytes each rank holds in parameters, gradient
buffers, main parameters and optimizer states (distinct storages, counted by
``_memory_worker.py``) must equal :func:`megarl.planner.memory.model_state` *exactly*: the planner
reproduces Megatron's buffer padding (parameters start at multiples of 64 elements and buckets
end at multiples of lcm(DP, 128) with the distributed optimizer). On CPU the optimizer is
torch's ``Adam`` (one 4-byte ``step`` tensor per main-parameter tensor: ``adam="torch"``) and the
layer spec is the local one (RMSNorm weights stay fp32 in a bf16 model: ``impl="local"``).

Activations: the bytes saved for backward in one training micro-batch (``saved_tensors_hooks``,
distinct non-parameter storages) within 10% of the planner's estimate, with and without
recomputation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config.model_dims import ModelDims, read_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.planner.activations import Recompute, training_activations
from megarl.planner.memory import OptimizerAssumptions, model_state
from tests.conftest import run_torchrun

WORKER = Path(__file__).with_name("_memory_worker.py")
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> dict:
    from megarl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("memory")
    models = {
        "qwen2": str(make_tiny_model(tmp / "qwen2", family="qwen2", seed=1)),
        "llama_tied": str(
            make_tiny_model(tmp / "llama", family="llama", seed=2, tie_word_embeddings=True)
        ),
    }
    spec = {"models": models, "tmp": str(tmp)}
    (tmp / "spec.json").write_text(json.dumps(spec))
    return spec


def _results(spec: dict, world: int) -> list[dict]:
    out = Path(spec["tmp"]) / f"memory_ws{world}.json"
    if not out.exists():
        run_torchrun(WORKER, world, [str(Path(spec["tmp"]) / "spec.json")])
    return json.loads(out.read_text())


def _dims(spec: dict, model: str) -> ModelDims:
    return ModelDims.from_hf_config(read_hf_config(spec["models"][model]))


@pytest.mark.parametrize("world", [1, 2])
def test_model_state_bytes_equal_what_megatron_holds(spec, world):
    held = [
        r for r in _results(spec, world) if "activations" not in r and "recompute_grads" not in r
    ]
    # 1 layout at world 1, 3 at world 2; 3 models × 2 dtypes × 2 optimizers; every rank reports
    assert len(held) == (12 if world == 1 else 3 * 12 * 2)
    for r in held:
        tp, pp, _ = r["layout"]
        opt = OptimizerAssumptions(
            dtype=r["dtype"],
            distributed_optimizer=r["distributed_optimizer"],
            adam="torch",
            impl="local",
        )
        planned = model_state(
            _dims(spec, r["model"]),
            ParallelLayout(tp, pp),
            world,
            r["role"],
            opt,
            pp_rank=r["pp_rank"],
            dp_rank=r["dp_rank"],
        )
        got = {k: r[k] for k in ("params", "grads", "main_params", "optimizer_states")}
        want = {
            "params": planned.params,
            "grads": planned.grads,
            "main_params": planned.main_params,
            "optimizer_states": planned.optimizer_states,
        }
        assert got == want, r


def test_model_state_cases_are_not_trivial(spec):
    """The matrix exercises what the formulas distinguish (else equality would prove little)."""
    held = [r for r in _results(spec, 1) if "activations" not in r and "recompute_grads" not in r]
    by = {(r["model"], r["role"], r["dtype"], r["distributed_optimizer"]): r for r in held}
    bf16 = by[("qwen2", "actor", "bf16", True)]
    fp32 = by[("qwen2", "actor", "fp32", True)]
    assert bf16["main_params"] > 0 and fp32["main_params"] == 0  # fp32 steps the params
    assert bf16["params"] < 0.6 * fp32["params"]  # 16-bit parameters (norm weights stay fp32)
    assert bf16["grads"] > 1.9 * bf16["params"]  # fp32 gradients of bf16 parameters
    critic = by[("qwen2", "critic", "fp32", False)]
    assert critic["params"] < fp32["params"]  # a value head instead of the output layer


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize(
    "recompute", [(None, None, None), ("full", "uniform", 1), ("full", "block", 1)]
)
def test_saved_activations_within_10_percent(spec, role, recompute):
    measured = [
        r
        for r in _results(spec, 1)
        if r.get("activations")
        and r["role"] == role
        and tuple(r["recompute"]) == recompute
        and r.get("dtype", "fp32") == "fp32"
    ]
    assert len(measured) == 2
    dims = _dims(spec, "qwen2")
    for r in measured:
        est = training_activations(
            dims,
            ParallelLayout(),
            micro_batch=r["micro_batch"],
            seq_len=r["seq"],
            micro_batches=1,
            dtype="fp32",
            impl="local",
            role=role,
            recompute=Recompute(*recompute),
        )
        assert abs(est.saved - r["saved"]) <= 0.10 * r["saved"], (est, r)


def test_recompute_leaves_the_gradients_bit_identical(spec):
    """Full (uniform over 1 and 2 layers, block) and selective recompute (core_attn; core_attn
    and mlp) of the actor and the critic, built as ``megarl train`` builds them: every
    gradient equals the one without recompute, bit for bit (not merely close)."""
    checks = [r for r in _results(spec, 1) if r.get("recompute_grads")]
    assert len(checks) == 10, checks
    for r in checks:
        assert r["identical"] and r["max_diff"] == 0.0 and r["nonzero"] > 0, r
        assert r["saved"] < r["saved_without"], r  # it did recompute
    for role in ("actor", "critic"):  # recompute_modules reached Megatron: mlp saves more
        selective = {len(r["recompute"]): r["saved"] for r in checks
                     if r["role"] == role and r["recompute"][0] == "selective"}  # fmt: skip
        assert selective[4] < selective[3], selective


def test_saved_activations_in_bf16_within_10_percent(spec):
    """16-bit adds the fp32 softmax output and the norms' fp32 copies (33 % more than counting
    every saved tensor at 2 bytes, at s = 160)."""
    measured = [r for r in _results(spec, 1) if r.get("activations") and r.get("dtype") == "bf16"]
    assert len(measured) == 2
    dims = _dims(spec, "qwen2")
    for r in measured:
        est = training_activations(
            dims, ParallelLayout(), micro_batch=r["micro_batch"], seq_len=r["seq"],
            micro_batches=1, dtype="bf16", impl="local",
        )  # fmt: skip
        assert abs(est.saved - r["saved"]) <= 0.10 * r["saved"], (est, r)
