"""``*.megatron.override_transformer_config``: each entry verl's scripts set is honoured (moved
onto megarl's ``megatron.*`` key, passed to ``TransformerConfig``, or accepted with no effect) or
refused in one line; nothing the HF weight mapping reads can be changed."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config, validate
from tests.conftest import REPO

TINY = REPO / "configs" / "grpo_tiny_cpu.yaml"
OTC = "actor_rollout_ref.actor.megatron.override_transformer_config"


def _problems(overrides: list[str]) -> list[str]:
    try:
        validate(load_config(TINY, overrides))
    except ConfigError as exc:
        return exc.problems
    return []


def test_verls_recompute_and_fusion_entries_become_megarls_keys():
    """As verl's scripts spell them: ``+...override_transformer_config.recompute_*`` (Hydra's
    plus), plain (verl's YAML has them), and ``++``."""
    cfg = load_config(TINY, [
        f"+{OTC}.recompute_granularity=full", f"{OTC}.recompute_method=uniform",
        f"++{OTC}.recompute_num_layers=1", f"+{OTC}.apply_rope_fusion=False",
        "+critic.megatron.override_transformer_config.recompute_modules=[core_attn,mlp]",
        f"+{OTC}.masked_softmax_fusion=True", f"+{OTC}.attention_backend=flash",
    ])  # fmt: skip
    meg = cfg.actor_rollout_ref.actor.megatron
    assert (meg.recompute_granularity, meg.recompute_method, meg.recompute_num_layers) == (
        "full", "uniform", 1)  # fmt: skip
    assert meg.apply_rope_fusion is False
    assert cfg.critic.megatron.recompute_modules == ["core_attn", "mlp"]
    assert meg.override_transformer_config == {"attention_backend": "flash"}  # passed through
    validate(cfg)


@pytest.mark.parametrize(
    ("entry", "line"),
    [
        ("hidden_size=64", f"{OTC}.hidden_size=64: the model's shape comes from its config.json"),
        ("num_layers=2", f"{OTC}.num_layers=2: the model's shape comes from its config.json"),
        ("tensor_model_parallel_size=1", (f"{OTC}.tensor_model_parallel_size=1: the layout is "
         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size; set that instead")),
        ("num_layers_in_first_pipeline_stage=0", (f"{OTC}.num_layers_in_first_pipeline_stage=0: "
         f"a stage holds at least one layer; {OTC}.num_layers_in_first_pipeline_stage=4 works")),
        ("account_for_loss_in_pipeline_split=2", (f"{OTC}.account_for_loss_in_pipeline_split=2 "
         "is not a boolean; the even split (the four split fields unset) works")),
        ("attention_backend=sdpa", (f"{OTC}.attention_backend=sdpa: not a Megatron attention "
         "backend; use one of auto, flash, fused, unfused, local")),
        ("fp8=hybrid", f"{OTC}.fp8 is not passed to TransformerConfig by megarl; it takes"),
    ],
)  # fmt: skip
def test_entries_megarl_cannot_apply_are_refused_in_one_line(entry, line):
    problems = _problems([f"+{OTC}.{entry}"])
    assert len(problems) == 1 and problems[0].startswith(line), problems


PP2 = [
    "trainer.n_gpus_per_node=4",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
]


def test_uneven_pipeline_split_is_the_layout():
    """The split entries become the actor's layout (built, resharded and checkpointed by it:
    the multi-rank tests); a split Megatron refuses names a value that works; the critic and
    the reference model split as the actor."""
    cfg = load_config(TINY, [*PP2, f"+{OTC}.num_layers_in_first_pipeline_stage=1"])
    validate(cfg)
    layout = cfg.actor_rollout_ref.actor.megatron.parallel_layout()
    assert layout.pipeline_split() == {"num_layers_in_first_pipeline_stage": 1}
    assert _problems([*PP2, f"+{OTC}.num_layers_in_last_pipeline_stage=4"]) == [
        (
            f"{OTC}.num_layers_in_last_pipeline_stage=4 leave 0 of num_hidden_layers=4 for 1 other "
            "stage of actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2; "
            f"{OTC}.num_layers_in_last_pipeline_stage=1 works (model shape from "
            "actor_rollout_ref.model.architecture)"
        )
    ]
    ref = "actor_rollout_ref.ref.megatron.override_transformer_config"
    assert _problems([*PP2, f"+{OTC}.num_layers_in_first_pipeline_stage=1",
                      f"+{ref}.num_layers_in_first_pipeline_stage=3"]) == [
        (f"{ref}.num_layers_in_first_pipeline_stage=3: the layers split as the actor's ({OTC}."
        "num_layers_in_first_pipeline_stage=1, one parallel layout per process); set 1")
    ]  # fmt: skip


def test_the_critic_gives_the_actors_split():
    """PPO's critic is built at the actor's layout: its split entries must equal the actor's."""
    ppo = REPO / "configs" / "ppo_tiny_cpu.yaml"
    first = "num_layers_in_first_pipeline_stage"
    critic = "critic.megatron.override_transformer_config"
    try:
        validate(load_config(ppo, [*PP2, f"+{OTC}.{first}=1"]))
    except ConfigError as exc:
        assert exc.problems == [
            (
                f"{critic}.{first}=null: the layers split as the actor's ({OTC}.{first}=1, one "
                "parallel layout per process); set 1"
            )
        ]
    else:
        raise AssertionError("the critic's missing split was accepted")
    validate(load_config(ppo, [*PP2, f"+{OTC}.{first}=1", f"+{critic}.{first}=1"]))


def test_verls_defaults_are_accepted_at_their_values():
    problems = _problems([
        f"+{OTC}.num_layers_in_first_pipeline_stage=null",
        f"+{OTC}.account_for_embedding_in_pipeline_split=false",
        f"{OTC}.recompute_modules=[core_attn]", f"{OTC}.attention_backend=flash",
    ])  # fmt: skip
    assert not problems, problems


@pytest.mark.parametrize(
    ("entry", "line"),
    [
        ("moe_router_dtype=fp32", None),  # megarl's router is fp32 already
        ("moe_grouped_gemm=True", None),  # TE's kernel: the TE spec only
        ("moe_permute_fusion=True", None),
        ("moe_shared_expert_overlap=True", None),
        ("moe_token_dispatcher_type=alltoall", None),
        ("moe_router_dtype=fp64", f"{OTC}.moe_router_dtype=fp64: megarl's router computes in fp32"),
        ("moe_router_topk=4", f"{OTC}.moe_router_topk=4: the model's shape comes from its config"),
        ("moe_token_dispatcher_type=flex", (f"{OTC}.moe_token_dispatcher_type=flex: the flex "
         "dispatcher needs DeepEP (deep_ep), which this machine lacks")),
        ("moe_enable_deepep=True", f"{OTC}.moe_enable_deepep=true: the flex dispatcher needs DeepEP"),
    ],
)  # fmt: skip
def test_verls_moe_knobs_validate_or_are_refused_in_one_line(entry, line):
    """The MoE knobs verl's scripts set, checked in validation (the builder checks the same)."""
    import importlib.util

    if ("flex" in entry or "deepep" in entry) and importlib.util.find_spec("deep_ep"):
        pytest.skip("DeepEP is installed here")
    problems = _problems([f"+{OTC}.{entry}"])
    if line is None:
        assert not problems, problems
    else:
        assert len(problems) == 1 and problems[0].startswith(line), problems
