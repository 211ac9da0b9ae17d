"""Every key of verl 0.9.1's Megatron trainer config, set alone to verl's default on
``configs/grpo_tiny_cpu.yaml``, loads and validates; the few that do not conflict with the tiny
config's layout or fp32 dtype, each in one line. The keys and defaults come from verl's own
generated YAML, vendored as ``megarl/config/data/verl_ppo_megatron_trainer.yaml`` (its header
names the wheel and version): the next verl release is that one file.

In-process (``load_config`` + ``validate`` per key, a few seconds in all).
"""

from __future__ import annotations

import json

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.config.verl_defaults import (
    VERL_YAML,
    resolved_default,
    verl_defaults,
    verl_sections,
)
from tests.conftest import REPO

TINY = REPO / "configs" / "grpo_tiny_cpu.yaml"

KEYS = tuple(
    k for k in verl_defaults() if k.rsplit(".", 1)[-1] != "_target_" and "profiler" not in k
)
"""verl's leaf keys less Hydra's ``_target_`` entries and the profiler sections (735)."""

CONFLICTS = {
    # the tiny config's layout and batch sizes (verl's defaults are for 8 GPUs and 256 prompts)
    "actor_rollout_ref.actor.ppo_mini_batch_size": "data.train_batch_size=8 is not divisible",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "ppo_micro_batch_size_per_gpu must be set",
    "actor_rollout_ref.rollout.n": "is not divisible by",
    "trainer.n_gpus_per_node": "is not divisible by",
    "actor_rollout_ref.rollout.name": "'???' is not one of",  # verl's "mandatory" marker
    # the tiny config runs fp32; verl's defaults name bfloat16
    "actor_rollout_ref.actor.megatron.dtype": "megarl's dtype is trainer.dtype (fp32)",
    "actor_rollout_ref.ref.megatron.dtype": "megarl's dtype is trainer.dtype (fp32)",
    "critic.megatron.dtype": "megarl's dtype is trainer.dtype (fp32)",
    "actor_rollout_ref.rollout.dtype": "megarl's rollout runs at trainer.dtype (fp32)",
}  # fmt: skip
"""Key -> the start of its one-line refusal on the tiny config."""


def _cli(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _refusals(values: dict) -> dict[str, list[str]]:
    out = {}
    for key, value in values.items():
        try:
            validate(load_config(TINY, [f"{key}={_cli(value)}"]))
        except ConfigError as exc:
            out[key] = exc.problems
    return out


def test_the_vendored_file_is_verl_0_9_1s():
    header = VERL_YAML.read_text().split("\n# This reference", 1)[0]
    assert "verl==0.9.1" in header and "_generated_ppo_megatron_trainer.yaml" in header
    assert len(verl_defaults()) == 942 and len(KEYS) == 735
    assert verl_defaults()["actor_rollout_ref.actor.optim.clip_grad"] == 1.0
    assert "actor_rollout_ref.actor.megatron.qat" in verl_sections()
    assert resolved_default("critic.ppo_epochs") == 1  # ${oc.select:...actor.ppo_epochs,1}
    assert resolved_default("critic.checkpoint.load_contents") == ["model", "optimizer", "extra"]


@pytest.mark.parametrize("resolved", [False, True], ids=["as-written", "resolved"])
def test_each_verl_key_alone_at_verls_default_loads_and_validates(resolved):
    """As written (``${oc.select:...}`` references and all) and as verl resolves them in its own
    tree (a pasted resolved config: then a few more conflict with the tiny layout)."""
    values = {k: resolved_default(k) if resolved else verl_defaults()[k] for k in KEYS}
    if resolved:  # only the ${...} defaults differ from the written ones
        values = {k: v for k, v in values.items() if v is not verl_defaults()[k]}
        assert len(values) == 57  # all but rollout.qat (a nested ${...})
    refused = _refusals(values)
    assert len(values) - len(refused) >= 0.9 * len(values), sorted(refused)
    assert len(refused) <= 0.05 * len(KEYS), sorted(refused)
    conflicts = dict(CONFLICTS)
    if resolved:  # verl's resolved values of the interpolated keys: 1 response, TP 1
        conflicts.update({f"{r}.rollout_n": "responses per prompt are" for r in
                          ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")})  # fmt: skip
        conflicts["actor_rollout_ref.ref.megatron.tensor_model_parallel_size"] = "Megatron-Core"
    for key, problems in refused.items():
        assert key in conflicts, (key, problems)
        assert not any("\n" in p for p in problems), (key, problems)  # one line each
        assert any(conflicts[key] in p for p in problems), (key, problems)


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "actor_rollout_ref.rollout.full_determinism=true",
            (
                "unsupported: actor_rollout_ref.rollout.full_determinism=true (use engine_kwargs; "
                "verl's default false is accepted)"
            ),
        ),
        (
            "actor_rollout_ref.actor.qat.enable=true",
            (
                "unsupported: actor_rollout_ref.actor.qat.enable=true (no quantization-aware "
                "training; verl's default false is accepted)"
            ),
        ),
        (
            "+actor_rollout_ref.model.tiled_mlp.enabled=true",
            (
                "unsupported: actor_rollout_ref.model.tiled_mlp.enabled=true (no tiled MLP; verl's "
                "default false is accepted)"
            ),
        ),
        (
            "actor_rollout_ref.model.lora_rank=8",
            (
                "unsupported: actor_rollout_ref.model.lora_rank=8 (verl's FSDP LoRA key; megarl takes "
                "the Megatron ones: actor_rollout_ref.model.lora.*; verl's default 0 is accepted)"
            ),
        ),
    ],
)
def test_a_value_other_than_verls_default_is_refused_naming_the_default(override, line):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    assert info.value.problems == [line]


def test_a_pasted_verl_section_at_its_defaults_is_accepted(tmp_path):
    """A YAML file holding verl's own sections (qat, mtp, checkpoint_engine, reward.reward_model,
    trainer.v1 ...) as verl's generated file writes them."""
    tree = {
        "actor_rollout_ref": {
            "actor": {"qat": {}, "megatron": {"qat": {}, "router_replay": {}}},
            "model": {"mtp": {}, "tiled_mlp": {}},
            "rollout": {"checkpoint_engine": {}, "trace": {}, "agent": {}},
        },
        "reward": {"reward_model": {}},
        "trainer": {"v1": {}},
        "distillation": {},
    }

    def fill(node: dict, prefix: str) -> None:
        for name, sub in node.items():
            key = f"{prefix}.{name}" if prefix else name
            if sub:
                fill(sub, key)
                continue
            inner = {k[len(key) + 1 :]: v for k, v in verl_defaults().items()
                     if k.startswith(key + ".") and not k.endswith("_target_")}  # fmt: skip
            for dotted, value in inner.items():
                *path, leaf = dotted.split(".")
                at = sub
                for part in path:
                    at = at.setdefault(part, {})
                at[leaf] = value

    fill(tree, "")
    import yaml

    (tmp_path / "verl.yaml").write_text(yaml.safe_dump({"_base_": str(TINY), **tree}))
    validate(load_config(tmp_path / "verl.yaml"))
    tree["actor_rollout_ref"]["model"]["mtp"]["enable"] = True
    (tmp_path / "verl.yaml").write_text(yaml.safe_dump({"_base_": str(TINY), **tree}))
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "verl.yaml")
    assert info.value.problems == [
        (
            "unsupported: actor_rollout_ref.model.mtp.enable=true (no multi-token prediction; "
            "verl's default false is accepted)"
        )
    ]


@pytest.mark.parametrize(
    "override",
    [
        'trainer.logger=["console","mlflow"]',  # verl 0.9's JSON list, the shell's quotes removed
        """trainer.logger='["console","mlflow"]'""",  # ... and kept (a script run through eval)
        "trainer.logger=[console,mlflow]",
        "++trainer.logger=[console,mlflow]",  # Hydra's add-or-override
        "+trainer.logger=['console','mlflow']",
    ],
)
def test_verls_list_spellings(override):
    assert load_config(TINY, [override]).trainer.logger == ["console", "mlflow"]


def test_a_quoted_list_in_a_file_and_quoted_words(tmp_path):
    (tmp_path / "c.yaml").write_text(
        f'_base_: {TINY}\ntrainer:\n  logger: \'["console", "mlflow"]\'\n'
    )
    cfg = load_config(
        tmp_path / "c.yaml", ["algorithm.adv_estimator='grpo'", 'data.truncation="error"']
    )
    assert cfg.trainer.logger == ["console", "mlflow"]
    assert (cfg.algorithm.adv_estimator, cfg.data.truncation) == ("grpo", "error")
