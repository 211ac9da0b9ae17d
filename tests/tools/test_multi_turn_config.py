"""``actor_rollout_ref.rollout.multi_turn.*``: verl's keys load into the typed config, and what
megarl cannot do with them is refused in one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.config.verl_keys import unsupported_reason

GRPO = str(Path(__file__).resolve().parents[2] / "configs/grpo_tiny_cpu.yaml")
MT = "actor_rollout_ref.rollout.multi_turn"


def errors(tmp_path, *overrides: str) -> list[str]:
    (tmp_path / "tools.yaml").write_text("tools: []\n")
    try:
        validate(
            load_config(GRPO, [f"{MT}.tool_config_path={tmp_path / 'tools.yaml'}", *overrides]), 2
        )
    except ConfigError as exc:
        return [line for line in str(exc).splitlines() if MT in line]
    return []


def test_verl_keys_load_and_are_no_longer_unsupported():
    cfg = load_config(GRPO, [f"{MT}.max_assistant_turns=5", f"{MT}.max_parallel_calls=2",
                             f"{MT}.tool_response_truncate_side=left", f"{MT}.format=hermes",
                             f"{MT}.tokenization_sanity_check_mode=ignore_strippable"])  # fmt: skip
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert (mt.max_assistant_turns, mt.max_parallel_calls) == (5, 2)
    assert mt.tool_response_truncate_side == "left"
    assert unsupported_reason(f"{MT}.enable") is None
    assert unsupported_reason("actor_rollout_ref.rollout.agent.num_workers") is not None


def test_disabled_settings_validate(tmp_path):
    assert errors(tmp_path) == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([f"{MT}.format=gpt-oss"], "format=gpt-oss is not built; use hermes"),
        ([f"{MT}.max_parallel_calls=0"], "max_parallel_calls=0 must be positive"),
        ([f"{MT}.use_inference_chat_template=true"], "use_inference_chat_template=true"),
        ([f"{MT}.num_repeat_rollouts=2"], "num_repeat_rollouts"),
    ],
)
def test_refusals_name_the_key_in_one_line(tmp_path, overrides, expected):
    found = errors(tmp_path, *overrides)
    assert any(expected in line for line in found), found


def test_enable_without_tools_or_interactions_is_refused():
    with pytest.raises(ConfigError, match="needs .*tool_config_path, function_tool_path or"):
        validate(load_config(GRPO, [f"{MT}.enable=true"]), 2)


def test_a_missing_tool_file_is_named(tmp_path):
    cfg = load_config(GRPO, [f"{MT}.interaction_config_path={tmp_path / 'nope.yaml'}"])
    assert any("nope.yaml" in w and "does not exist" in w for w in validate(cfg, 2))


# verl's GSM8K tool-agent example: examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml
# (its keys as overrides, on verl's defaults as `megarl config validate` reads them without a
# config file) with rollout.name=vllm, and its tool config (test_registry's copy of verl 0.9's
# gsm8k_tool_config.yaml), data and model local.


def test_verls_gsm8k_tool_agent_example_validates(tmp_path, capsys):
    from megarl import cli
    from megarl.commands import data
    from megarl.models.tiny import make_tiny_model

    make_tiny_model(tmp_path / "model", family="qwen2")
    assert data.main(["synth", "--out", str(tmp_path / "data"), "--train-size", "8"]) == 0
    from tests.tools.test_registry import VERL_GSM8K_TOOL_CONFIG

    (tmp_path / "gsm8k_tool_config.yaml").write_text(VERL_GSM8K_TOOL_CONFIG)
    example = [  # the config's keys
        "data.max_prompt_length=1024", "data.max_response_length=1024",
        "data.train_batch_size=256", "data.return_raw_chat=True",
        "actor_rollout_ref.hybrid_engine=True", "actor_rollout_ref.rollout.name=vllm",
        f"{MT}.enable=True", f"{MT}.max_assistant_turns=5",
        # run_qwen2.5-3b_gsm8k_tool_agent_mlflow.sh's, less its FSDP offload and trace keys
        "algorithm.adv_estimator=grpo", "data.train_batch_size=1",
        "data.filter_overlong_prompts=False", "data.truncation='left'",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.gpu_memory_utilization=0.75",
        "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.save_freq=-1",
        "trainer.test_freq=20", "trainer.total_training_steps=2", "trainer.total_epochs=15",
        f"{MT}.tool_config_path={tmp_path / 'gsm8k_tool_config.yaml'}",
        f"actor_rollout_ref.model.path={tmp_path / 'model'}",
        f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
        f"data.val_files={tmp_path / 'data' / 'test.parquet'}",
    ]  # fmt: skip
    capsys.readouterr()
    code = cli.main(["config", "validate", *example])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("ok: ") and "error" not in err, (out, err)
    # the checks ran: the same example with a format megarl does not parse is refused
    assert cli.main(["config", "validate", *example, f"{MT}.format=gpt-oss"]) == 2


# The pre-flight of `megarl train` (its --check, in process): a broken interaction file or a chat
# template that cannot render the loop's turns is one line, exit 2, before any rank works (it
# was rank 0's error at set-up or at step 1).

NO_TOOL_ROLE = (  # a template that refuses tool messages (as Llama 2's refuses non-alternation)
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def check(tmp_path_factory, tiny_overrides):
    """``megarl train --check`` on the session's tiny model and data with the calculator: (exit
    code, error lines)."""
    from transformers import AutoTokenizer

    from megarl.commands import train

    root = tmp_path_factory.mktemp("mt_preflight")
    model = tiny_overrides[0].split("=", 1)[1]
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = NO_TOOL_ROLE
    tok.save_pretrained(str(root / "no_tool_role"))
    calculator = Path(__file__).resolve().parents[2] / "configs/tools/calculator.yaml"

    def run(capsys, *overrides: str) -> tuple[int, list[str]]:
        capsys.readouterr()
        code = train.main([
            "--check", "-c", GRPO, *tiny_overrides, f"trainer.default_local_dir={root / 'run'}",
            f"{MT}.enable=true", f"{MT}.tool_config_path={calculator}", *overrides,
        ])  # fmt: skip
        err = capsys.readouterr().err
        return code, [line for line in err.splitlines() if line.startswith("error")]

    return run, root


def test_the_preflight_passes_a_good_multi_turn_run(check, capsys):
    run, _ = check
    assert run(capsys) == (0, [])


def test_a_chat_template_without_tool_turns_is_refused_in_the_preflight(check, capsys):
    run, root = check
    code, errors = run(capsys, f"actor_rollout_ref.model.tokenizer_path={root / 'no_tool_role'}")
    assert code == 2 and len(errors) == 1, errors
    assert f"actor_rollout_ref.model.tokenizer_path={root / 'no_tool_role'}" in errors[0]
    assert "cannot render a 'tool' turn" in errors[0] and "must alternate" in errors[0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("interaction:\n  - name: g\n    class_name: nowhere.Missing\n    config: {}\n",
         "cannot import module 'nowhere'"),
        ("interaction: [oops\n", "not valid YAML"),
    ],
)  # fmt: skip
def test_a_broken_interaction_config_is_refused_in_the_preflight(check, capsys, text, expected):
    run, root = check
    (path := root / "interaction.yaml").write_text(text)
    code, errors = run(capsys, f"{MT}.interaction_config_path={path}")
    assert code == 2 and len(errors) == 1, errors
    assert str(path) in errors[0] and expected in errors[0], errors
