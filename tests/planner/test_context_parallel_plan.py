"""The planner under context parallelism: activations per GPU divided by CP, the distributed
optimizer sharded over DP × CP (Megatron's DDP group), token budgets per GPU × CP (verl's
meaning), and the long chain-of-thought config (16k-token responses) that fits at CP 2 only."""

from __future__ import annotations

from pathlib import Path

from megarl.commands import plan as plan_cli
from megarl.config import ConfigError, load_config, validate
from megarl.config.model_dims import ModelDims
from megarl.planner.memory_plan import Cluster, plan_memory
from megarl.planner.model_presets import PRESETS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CP = "actor_rollout_ref.actor.megatron.context_parallel_size"
LONG_72B = ["data.max_response_length=16384", "trainer.nnodes=16"]


def _terms(plan, phase: str) -> dict[str, int]:
    """A phase's terms by label, the ``(b=…, s=…[, /CP c])`` suffix dropped."""
    found = next(p for p in plan.phases if p.name == phase)
    return {t.name.split(" (")[0]: t.nbytes for t in found.terms}


def test_activations_halve_and_the_optimizer_shards_over_dp_times_cp():
    dims = ModelDims.from_hf_config(PRESETS["qwen2.5-72b"])
    cluster = Cluster(16, 8, 80.0)
    at = {cp: plan_memory(load_config(CONFIGS / "ppo_qwen2_5_72b.yaml", [*LONG_72B, f"{CP}={cp}"]),
                          dims, cluster) for cp in (1, 2)}  # fmt: skip
    one, two = _terms(at[1], "update_critic"), _terms(at[2], "update_critic")
    saved = "critic saved activations"
    assert abs(one[saved] / two[saved] - 2.0) < 0.01, (one[saved], two[saved])
    values_one, values_two = _terms(at[1], "values"), _terms(at[2], "values")
    forward = "forward activations, values"
    assert abs(values_one[forward] / values_two[forward] - 2.0) < 0.01
    # DP 8 at CP 1, DP 4 at CP 2: the same DP × CP shards of the optimizer state
    adam = "critic fp32 main params + Adam moments"
    assert one[adam] == two[adam] > 0


def test_the_long_cot_config_fits_at_cp2_and_names_the_budget_at_cp1(capsys):
    path = CONFIGS / "grpo_qwen2_5_32b_longcot.yaml"
    cfg = load_config(path)
    assert cfg.actor_rollout_ref.actor.megatron.context_parallel_size == 2
    assert validate(cfg, 32) == [] or all(not w.startswith("memory:") for w in validate(cfg, 32))
    assert plan_cli.main(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "× CP 2 → DP 2" in out and "/CP 2)" in out and "verdict: FITS" in out
    try:
        validate(load_config(path, [f"{CP}=1"]), 32)
        raise AssertionError("a 9216-token budget per GPU cannot hold a 17408-token sequence")
    except ConfigError as exc:
        assert any("ppo_max_token_len_per_gpu=9216 is below the longest sequence" in p
                   for p in exc.problems), exc.problems  # fmt: skip
