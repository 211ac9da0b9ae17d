"""``actor_rollout_ref.model.lora.*``: verl's Megatron LoRA keys are read; what megarl does not
build is refused in one line naming the key; the settings reach the adapters as given."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.config.verl_keys import unsupported_reason

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LORA_TINY = CONFIGS / "grpo_lora_tiny_cpu.yaml"
L = "actor_rollout_ref.model.lora"


def test_lora_tiny_config_validates_with_verl_names():
    cfg = load_config(LORA_TINY, [f"{L}.dropout=0.05", f"{L}.dropout_position=post",
                                  f"{L}.lora_A_init_method=kaiming"])  # fmt: skip
    validate(cfg, 2)
    from megarl.models.lora import LoraSettings

    s = LoraSettings.from_config(cfg.actor_rollout_ref.model.lora, seed=3)
    assert (s.rank, s.alpha, s.scaling, s.dropout, s.dropout_position, s.a_init, s.b_init) == (
        16, 32.0, 2.0, 0.05, "post", "kaiming", "zero")  # fmt: skip
    # verl: target_modules [] with exclude_modules = every linear but those (the output layer
    # too: Bridge's matcher, tests/config/test_lora_preflight.py)
    excluded = f"{L}.exclude_modules=[linear_fc2,output_layer]"
    cfg = load_config(LORA_TINY, [f"{L}.target_modules=[]", excluded])
    validate(cfg, 2)
    s = LoraSettings.from_config(cfg.actor_rollout_ref.model.lora)
    assert s.target_modules == ()
    assert s.exclude_modules == ("linear_fc2", "output_layer")


@pytest.mark.parametrize(
    ("override", "says"),
    [
        (f"{L}.type=dora", f"{L}.type=dora is not built"),
        (f"{L}.target_modules=[linear_q]", "are not linears megarl adapts"),
        (f"{L}.exclude_modules=[linear_fc2]", "needs target_modules=[]"),
        (f"{L}.adapter_path=/x", f"{L}.adapter_path=/x holds no adapter_config.json"),
        (f"{L}.lora_B_init_method=ones", f"{L}.lora_B_init_method=ones"),
        (f"{L}.dropout_position=middle", "must be pre or post"),
        ("actor_rollout_ref.actor.megatron.use_dist_checkpointing=true", "LoRA's base is"),
    ],
)  # fmt: skip
def test_what_is_not_built_is_refused_in_one_line(override, says):
    with pytest.raises(ConfigError) as info:
        validate(load_config(LORA_TINY, [override]), 2)
    problems = [p for p in info.value.problems if "lora" in p.lower()]
    assert len(problems) == 1 and says in problems[0] and "\n" not in problems[0], problems


def test_fsdp_and_critic_lora_keys_are_refused():
    assert "actor_rollout_ref.model.lora.*" in unsupported_reason(
        "actor_rollout_ref.model.lora_rank"
    )
    assert "critic" in unsupported_reason("critic.model.lora.rank")
    assert unsupported_reason(f"{L}.rank") is None


VERL_LORA = Path(__file__).parent / "data" / "verl_grpo_qwen2-7b_math_megatron_lora.txt"
"""verl's examples/grpo_trainer/run_qwen2-7b_math_megatron_lora.sh as an override list (data
paths dropped, its shell variables' values filled in)."""


def test_verls_megatron_lora_example_validates(capsys):
    """As given (TP 4, verl's default sequence_parallel=true, lora.merge=false, trainer.device
    cuda with transformer_impl auto, so Transformer Engine's spec, whose linears take adapters:
    ``tests/models/test_te_gpu.py``): valid, warnings only; on the local spec too."""
    from megarl import cli

    example = VERL_LORA.read_text().splitlines()
    assert cli.main(["config", "validate", *example]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ok: the defaults with these overrides is valid."), out
    assert all(line.startswith("warning:") for line in err.strip().splitlines()), err
    local = ["actor_rollout_ref.actor.megatron.transformer_impl=local"]  # SP on marked norms
    assert cli.main(["config", "validate", *example, *local]) == 0


def test_lora_with_sequence_parallelism_validates_on_cpu():
    """The CPU tiny config with SP at TP 2 (the local spec's norms marked for it)."""
    over = ["actor_rollout_ref.actor.megatron.sequence_parallel=true",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]  # fmt: skip
    validate(load_config(LORA_TINY, over), 2)


def test_adapter_only_sync_of_a_moe_model_is_refused_in_one_line():
    """Expert adapters train and sync merged (tests/trainer/test_lora_update.py,
    tests/rollout/test_reshard_sync.py); ``merge=false`` on a MoE model is refused at
    validation (the architecture section says MoE: no model files needed)."""
    moe = [CONFIGS / "grpo_moe_tiny_cpu.yaml"]
    lora = [f"{L}.rank=8", f"{L}.alpha=16"]
    validate(load_config(moe, [*lora, f"{L}.merge=true"]), 2)
    with pytest.raises(ConfigError) as info:
        validate(load_config(moe, [*lora, f"{L}.merge=false"]), 2)
    problems = info.value.problems
    assert len(problems) == 1 and f"{L}.merge=false on a Mixture-of-Experts model" in problems[0]


def test_adapter_only_sync_to_rollout_ranks_more_than_a_step_off_is_refused():
    """``merge=false`` with vLLM on ranks of its own: at most one step off (built,
    tests/trainer/test_lora_learning.py's main run); staged updates carry no adapters."""
    split = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
             "trainer.n_gpus_per_node=4"]  # fmt: skip
    validate(load_config(LORA_TINY, [*split, "async_training.staleness_threshold=1"]), 4)
    with pytest.raises(ConfigError) as info:
        validate(load_config(LORA_TINY, [*split, "async_training.staleness_threshold=2"]), 4)
    problems = [p for p in info.value.problems if "lora" in p.lower()]
    assert len(problems) == 1 and "needs async_training.staleness_threshold <= 1" in problems[0]
    validate(load_config(LORA_TINY, [*split, "async_training.staleness_threshold=2",
                                     f"{L}.merge=true"]), 4)  # fmt: skip
